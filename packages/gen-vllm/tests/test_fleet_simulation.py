"""A simulated fleet: the real ``VllmGeneration`` and its replica set, with the fake vLLM engine in
Ray actors, under a loop of generate and refit with faults injected at random (a worker
SIGKILLed or SIGSTOPped mid-call, a worker killed just before a refit, a worker paused mid-call
for less than the wedge bound: slow, not lost). Every call must equal
the fault-free call on the same weights, every row's tokens carry the fleet's one version,
and nothing is left running at the end. This is how healing is known to hold at sizes this
machine cannot run with real engines.

Size and length: ``GEN_FLEET_SIZE`` replicas (default 4) and ``GEN_FLEET_ROUNDS`` rounds
(default 2, each a refit then faulty calls; from the second on, a replica may die just before
the refit). The defaults keep the suite's run short (about 2 minutes here, against 3 at 8
replicas and 3 rounds: the time goes to the replacements' starts); larger runs take the
variables, e.g. ``GEN_FLEET_SIZE=16 GEN_FLEET_ROUNDS=6``. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time

import pytest
import torch
from fake_vllm_engine import FakeEngineFactory
from gen_interface.weights import refit
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts
from processes import running

SIZE = int(os.environ.get("GEN_FLEET_SIZE", "4"))
ROUNDS = int(os.environ.get("GEN_FLEET_ROUNDS", "2"))
CALLS_PER_ROUND = 2  # faulty calls compared with each round's reference
WEDGE_S = 10.0  # generous: two cores shared with replacements starting
PROMPTS = [[3 + i % 50, 17, 42 + i % 7, 8] for i in range(3 * SIZE)]


def _busy_pid(backend, rng: random.Random, call: threading.Thread) -> int | None:
    """The process of a random replica whose engine holds rows now; None if the call ended
    first."""
    while call.is_alive():
        members = backend.replicas.member_ids()
        busy = [r for r, n in zip(members, backend.rows_in_flight()) if n]
        if busy:
            return backend.replicas.infos[rng.choice(busy)]["pid"]
        time.sleep(0.01)
    return None


def _run_into(out: dict, backend, batch) -> None:
    out["result"] = backend.generate(batch)


def _weights(tiny, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.2 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in tiny.state_dict().items()
    }


@pytest.fixture
def fleet(fake_engine_shipped, tiny_qwen2, tmp_path):
    from gen_vllm import RayVirtualCluster, VllmGeneration

    cluster = RayVirtualCluster([SIZE], use_gpus=False, num_cpus_per_bundle=min(1.0, 8 / SIZE))
    config = conformance_config(
        backend="vllm",
        model_name=str(tiny_qwen2.path),
        vocab_size=512,
        max_new_tokens=64,
        stop_token_ids=[],
        vllm_cfg={
            "weight_deltas": True,
            "wedge_timeout_s": WEDGE_S,
            "max_replica_restarts": 100,
        },
    )
    try:
        backend = VllmGeneration(cluster, config, "sim", engine_factory=FakeEngineFactory(tmp_path))
    except BaseException:
        cluster.shutdown()
        raise
    yield backend
    backend.shutdown()
    cluster.shutdown()


def test_a_simulated_fleet_under_random_faults_returns_what_a_fault_free_fleet_does(
    fleet, tiny_qwen2
):
    backend = fleet
    rng = random.Random(41)
    batch = pad_prompts(PROMPTS, "left")
    pids_seen = {info["pid"] for info in backend.replicas.infos}
    faults: dict[str, int] = {"kill": 0, "stop": 0, "kill_before_refit": 0, "slow": 0}
    kinds = ["kill", "stop", "slow"]
    first_kind = rng.randrange(len(kinds))
    calls = 0
    extra_s: list[float] = []
    started = time.monotonic()

    def live_pid() -> int:
        members = backend.replicas.member_ids()
        return backend.replicas.infos[rng.choice(members)]["pid"]

    for round_ in range(ROUNDS):
        if round_ and rng.random() < 0.5:  # a replica dies just before the refit
            os.kill(live_pid(), signal.SIGKILL)
            faults["kill_before_refit"] += 1
        version = refit(backend, _weights(tiny_qwen2, round_))
        assert backend.fleet.wait_settled(120), backend.get_logger_metrics()
        pids_seen |= {info["pid"] for info in backend.replicas.infos}
        t0 = time.monotonic()
        reference = backend.generate(batch)  # fault-free, on this round's weights
        clean_s = time.monotonic() - t0
        calls += 1
        assert set(reference["weight_versions"][:, 4:].flatten().tolist()) == {version}
        for k in range(CALLS_PER_ROUND):
            # every kind in turn from a random start: any run of 3 calls or more has each
            kind = kinds[(first_kind + round_ * CALLS_PER_ROUND + k) % len(kinds)]
            out: dict = {}
            t0 = time.monotonic()
            call = threading.Thread(target=_run_into, args=(out, backend, batch))
            call.start()
            time.sleep(rng.uniform(0.0, 0.2))
            victim = _busy_pid(backend, rng, call)  # a replica holding rows of the call
            if victim is not None and kind == "slow":  # paused well within the wedge bound
                os.kill(victim, signal.SIGSTOP)
                time.sleep(rng.uniform(0.5, WEDGE_S / 5))
                os.kill(victim, signal.SIGCONT)
                faults[kind] += 1
            elif victim is not None:
                os.kill(victim, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                faults[kind] += 1
            call.join(timeout=120)
            calls += 1
            assert "result" in out, f"a call with a {kind} fault did not return"
            extra_s.append(time.monotonic() - t0 - clean_s)
            result = out["result"]
            assert torch.equal(result["output_ids"], reference["output_ids"])
            assert torch.equal(result["logprobs"], reference["logprobs"])
            # versions never mix: every token of every row from this round's weights
            assert set(result["weight_versions"][:, 4:].flatten().tolist()) == {version}
            assert backend.fleet.wait_settled(120), backend.get_logger_metrics()
            pids_seen |= {info["pid"] for info in backend.replicas.infos}

    metrics = backend.get_logger_metrics()
    fleet_view = {k: v for k, v in metrics.items() if k.startswith("fleet_") or "_state" in k}
    assert metrics["fleet_replicas_serving"] == SIZE, fleet_view
    assert {metrics[f"replica_{i}_weight_version"] for i in range(SIZE)} == {version}
    injected = sum(faults.values()) - faults["slow"]  # a slow replica is not lost
    heal = backend.fleet.heal_seconds or [0.0]  # none when every fault was a slow one
    print(
        f"\nsimulated fleet: {SIZE} replicas, {ROUNDS} rounds, {calls} calls, faults {faults}; "
        f"{metrics['fleet_faults_total']} replicas lost, {metrics['fleet_restarts_total']} "
        f"replaced, {metrics['fleet_rows_rerun_total']} rows re-run, "
        f"{metrics['fleet_rows_lost_total']} rows lost; time to heal (loss to admission) mean "
        f"{statistics.mean(heal):.1f} s, max {max(heal):.1f} s; a faulty call's extra wall "
        f"time mean {statistics.mean(extra_s):.2f} s, max {max(extra_s):.2f} s; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    assert metrics["fleet_faults_total"] == injected
    assert metrics["fleet_restarts_total"] == injected
    assert metrics["fleet_rows_lost_total"] == 0  # nothing streamed: every row re-ran
    backend.shutdown()
    deadline = time.monotonic() + 30
    while any(running(p) for p in pids_seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids_seen if running(p)], "processes left running"
