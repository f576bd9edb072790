"""A simulated fleet: the real ``VllmGeneration`` and its replica set, with the fake vLLM engine in
Ray actors on Ray's multi-node test cluster (``ray.cluster_utils.Cluster``: one raylet per node,
all on this machine), under a loop of generate and refit with faults injected at random: a
worker SIGKILLed or SIGSTOPped mid-call, a worker killed just before a refit, a worker paused
mid-call for less than the wedge bound (slow, not lost), and a node removed mid-call (its raylet
and every process on it stopped, as when a machine is lost; a fresh node then joins, as a
cluster's repair would add one). Each replica has a node of its own and one node is spare, so a
replica whose node is lost is replaced on another node, from a peer's copy of the committed
weights relayed across nodes. Every call must equal the fault-free call on the same weights,
every row's tokens carry the fleet's one version, and nothing is left running at the end. This
is how healing is known to hold at sizes this machine cannot run with real engines.

Size and length: ``GEN_FLEET_SIZE`` replicas (default 4) and ``GEN_FLEET_ROUNDS`` rounds
(default 2, each a refit then faulty calls; from the second on, a replica may die just before
the refit). The defaults keep the suite's run short (the time goes to the replacements' starts);
larger runs take the variables, e.g. ``GEN_FLEET_SIZE=16 GEN_FLEET_ROUNDS=6``. Run with ``-s``
to see the figures. The loop runs in a subprocess (this file, run as a script;
``simulated_cluster``); a check that fails there fails the test with the loop's traceback.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from simulated_cluster import (
    assert_exited,
    busy_replica,
    healing_fleet,
    remove_node_of,
    run_as_scenario,
    scenario_report,
    simulated_nodes,
)

SIZE = int(os.environ.get("GEN_FLEET_SIZE", "4"))
ROUNDS = int(os.environ.get("GEN_FLEET_ROUNDS", "2"))
CALLS_PER_ROUND = 2  # faulty calls compared with each round's reference
WEDGE_S = 10.0  # generous: two cores shared with replacements starting
PROMPTS = [[3 + i % 50, 17, 42 + i % 7, 8] for i in range(3 * SIZE)]
KINDS = ["kill", "stop", "slow", "node"]
#: Starts of the cluster and the fleet, the loop, shutdown; on a busy 2-core machine.
TIMEOUT_S = 300 + 150 * SIZE * ROUNDS


def test_a_simulated_fleet_under_random_faults_returns_what_a_fault_free_fleet_does(
    tiny_qwen2, tmp_path
):
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    seen = scenario_report(__file__, tiny_qwen2.path, tmp_path, TIMEOUT_S)
    metrics, faults = seen["metrics"], seen["faults"]
    heal = seen["heal_seconds"] or [0.0]  # none when every fault was a slow one
    print(
        f"\nsimulated fleet: {SIZE} replicas on {SIZE + 1} nodes, {ROUNDS} rounds, "
        f"{seen['calls']} calls, faults {faults}; {metrics['fleet_faults_total']} replicas "
        f"lost, {metrics['fleet_restarts_total']} replaced ({metrics['fleet_copies_relayed_total']}"
        f" from a peer on another node), {metrics['fleet_rows_rerun_total']} rows re-run, "
        f"{metrics['fleet_rows_lost_total']} rows lost; time to heal (loss to admission) mean "
        f"{statistics.mean(heal):.1f} s, max {max(heal):.1f} s; a faulty call's extra "
        f"wall time mean {statistics.mean(seen['extra_s']):.2f} s, max "
        f"{max(seen['extra_s']):.2f} s; {seen['seconds']:.0f} s in all"
    )
    if len(KINDS) <= ROUNDS * CALLS_PER_ROUND:  # every kind had its turn
        assert all(faults[kind] for kind in KINDS), faults
    injected = sum(faults.values()) - faults["slow"]  # a slow replica is not lost
    assert metrics["fleet_replicas_serving"] == SIZE, metrics
    assert set(seen["replica_versions"]) == {seen["version"]}
    assert metrics["fleet_faults_total"] == injected
    assert metrics["fleet_restarts_total"] == injected
    assert metrics["fleet_rows_lost_total"] == 0  # nothing streamed: every row re-ran
    # a replica whose node was lost came back on another node, from a relayed copy
    assert metrics["fleet_copies_relayed_total"] >= faults["node"]
    assert not any(seen["nodes_alive_after_shutdown"])
    assert_exited(seen["pids"])


# ---- the loop (its own process) ----------------------------------------------------------------


def _simulation(model_dir: str, log_dir: str) -> dict[str, Any]:
    """A cluster of ``SIZE`` + 1 one-CPU nodes and a head without CPUs; the fleet's loop on it."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    seen: dict[str, Any] = {}
    with simulated_nodes(SIZE + 1, seen) as (cluster, nodes):
        _loop_on_fleet(cluster, nodes, model_dir, log_dir, seen)
    seen["seconds"] = time.monotonic() - started
    return seen


def _loop_on_fleet(
    cluster: Any, nodes: list[Any], model_dir: str, log_dir: str, seen: dict[str, Any]
) -> None:
    import torch
    from gen_interface.weights import refit
    from gen_testkit.strategies import pad_prompts
    from refit_faults import perturbed_weights
    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    placement, backend = healing_fleet(
        cluster, model_dir, log_dir, SIZE, wedge_s=WEDGE_S, restarts=100
    )
    rng = random.Random(41)
    batch = pad_prompts(PROMPTS, "left")
    pids = {info["pid"] for info in backend.replicas.infos}
    faults = dict.fromkeys([*KINDS, "kill_before_refit"], 0)
    first_kind = rng.randrange(len(KINDS))
    calls = 0
    extra_s: list[float] = []

    def live_pid() -> int:
        members = backend.replicas.member_ids()
        return backend.replicas.infos[rng.choice(members)]["pid"]

    try:
        for round_ in range(ROUNDS):
            if round_ and rng.random() < 0.5:  # a replica dies just before the refit
                os.kill(live_pid(), signal.SIGKILL)
                faults["kill_before_refit"] += 1
            version = refit(backend, perturbed_weights(checkpoint, round_))
            assert backend.fleet.wait_settled(120), backend.get_logger_metrics()
            pids |= {info["pid"] for info in backend.replicas.infos}
            t0 = time.monotonic()
            reference = backend.generate(batch)  # fault-free, on this round's weights
            clean_s = time.monotonic() - t0
            calls += 1
            assert set(reference["weight_versions"][:, 4:].flatten().tolist()) == {version}
            for k in range(CALLS_PER_ROUND):
                # every kind in turn from a random start: any run of 4 calls or more has each
                kind = KINDS[(first_kind + round_ * CALLS_PER_ROUND + k) % len(KINDS)]
                out: dict[str, Any] = {}
                t0 = time.monotonic()
                call = threading.Thread(target=_run_into, args=(out, backend, batch))
                call.start()
                time.sleep(rng.uniform(0.0, 0.2))
                victim = busy_replica(backend, call, rng)  # a replica holding rows of the call
                if victim is not None:
                    _inject(kind, victim, backend, cluster, nodes, rng)
                    faults[kind] += 1
                call.join(timeout=120)
                calls += 1
                assert "result" in out, f"a call with a {kind} fault did not return"
                extra_s.append(time.monotonic() - t0 - clean_s)
                result = out["result"]
                assert torch.equal(result["output_ids"], reference["output_ids"]), kind
                assert torch.equal(result["logprobs"], reference["logprobs"]), kind
                # versions never mix: every token of every row from this round's weights
                assert set(result["weight_versions"][:, 4:].flatten().tolist()) == {version}
                assert backend.fleet.wait_settled(120), backend.get_logger_metrics()
                pids |= {info["pid"] for info in backend.replicas.infos}
        metrics = backend.get_logger_metrics()
        seen.update(
            faults=faults,
            calls=calls,
            extra_s=extra_s,
            version=version,
            heal_seconds=backend.fleet.heal_seconds,
            replica_versions=[metrics[f"replica_{i}_weight_version"] for i in range(SIZE)],
            metrics={k: v for k, v in metrics.items() if k.startswith("fleet_")},
        )
    finally:
        backend.shutdown()
        placement.shutdown()
        seen["pids"] = sorted(pids)


def _run_into(out: dict[str, Any], backend: Any, batch: Any) -> None:
    out["result"] = backend.generate(batch)


def _inject(
    kind: str, victim: int, backend: Any, cluster: Any, nodes: list[Any], rng: random.Random
) -> None:
    """One fault on replica ``victim``, mid-call."""
    info = backend.replicas.infos[victim]
    if kind == "slow":  # paused well within the wedge bound
        os.kill(info["pid"], signal.SIGSTOP)
        time.sleep(rng.uniform(0.5, WEDGE_S / 5))
        os.kill(info["pid"], signal.SIGCONT)
    elif kind == "node":  # its machine is lost; a fresh one joins, so a node stays spare
        remove_node_of(cluster, backend, victim)
        nodes.append(cluster.add_node(num_cpus=1))
    else:
        os.kill(info["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


if __name__ == "__main__":
    run_as_scenario(_simulation)
