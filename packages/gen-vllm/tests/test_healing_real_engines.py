"""A fleet that heals, on real vLLM engines (2 replicas on CPU): after a refit (the weights are
on no disk), a worker SIGKILLed mid-call and then another SIGSTOPped mid-call: each call returns
what the fault-free call returned (the testkit's near-tie rule: a re-run row lands in another
batch, and vLLM's CPU build is not batch-invariant), at the same version; the fleet gets back
to full size from a peer's copy of the committed weights; a later refit reaches every replica.
Then a worker SIGKILLed in a refit, after its loads and before the commit: the refit commits on
the survivor, and the replacement takes that version from the survivor's copy. Then a
replacement SIGKILLed in its own load of the survivor's copy: another follows and is admitted.
Last, every worker SIGKILLed mid-call: the call fails with a typed, retryable error within
seconds, so do calls while no replica serves, and the next refit brings the whole fleet back
(no copy of the weights outlived the replicas, so the replacements join that refit)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from gen_interface import NoReplicaServingError
from gen_interface.weights import refit
from gen_testkit.compare import compare_generations
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts
from gen_testkit.tolerances import tolerance_for
from refit_faults import KillBeforeCommit, KillDuringLoad, perturbed_weights

PROMPTS = [[5 + i, 17, 42 + 3 * i, 8] for i in range(16)]
SETTLE_S = 240  # a replacement engine's start on two busy cores


@pytest.fixture
def backend(ray_session, tiny_qwen2):
    from gen_vllm import RayVirtualCluster, VllmGeneration

    cluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1)
    config = conformance_config(
        backend="vllm",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        max_new_tokens=64,
        stop_token_ids=[],
        vllm_cfg={"cpu_kv_cache_gib": 0.25, "weight_deltas": True, "wedge_timeout_s": 8.0},
    )
    made = VllmGeneration(cluster, config, "heal")
    yield made
    made.shutdown()
    cluster.shutdown()


def _moved(tiny, seed: int) -> dict[str, torch.Tensor]:
    return perturbed_weights(tiny.state_dict(), seed)


def _faulty_call(backend, replica: int, sig: signal.Signals) -> tuple[dict, float]:
    """Generate while ``replica``'s worker takes ``sig`` once it holds rows; the output and
    the call's wall time."""
    out: dict = {}
    batch = pad_prompts(PROMPTS, "left")
    started = time.monotonic()
    thread = threading.Thread(target=lambda: out.update(result=backend.generate(batch, True)))
    thread.start()
    pid = backend.replicas.infos[replica]["pid"]
    while thread.is_alive():
        counts = dict(zip(backend.replicas.member_ids(), backend.rows_in_flight()))
        if counts.get(replica):
            os.kill(pid, sig)
            break
        time.sleep(0.01)
    thread.join(timeout=180)
    assert "result" in out, "the call did not return"
    return out["result"], time.monotonic() - started


def _versions(output) -> set[int]:
    return set(output["weight_versions"][:, len(PROMPTS[0]) :].flatten().tolist())


def test_a_worker_killed_and_another_stopped_mid_call_cost_a_re_run_and_the_fleet_heals(
    backend, tiny_qwen2
):
    tolerance = tolerance_for("float32", across_backends=False)
    version = refit(backend, _moved(tiny_qwen2, 1))
    batch = pad_prompts(PROMPTS, "left")
    backend.generate(batch, greedy=True)  # warm: the first call of an engine costs seconds more
    started = time.monotonic()
    reference = backend.generate(batch, greedy=True)
    clean_s = time.monotonic() - started
    assert _versions(reference) == {version}

    for replica, sig in ((0, signal.SIGKILL), (1, signal.SIGSTOP)):
        pid = backend.replicas.infos[replica]["pid"]
        result, wall_s = _faulty_call(backend, replica, sig)
        report = compare_generations(
            reference, result, logprob_atol=tolerance.logprob_atol, near_tie=tolerance.near_tie
        )
        report.assert_ok(f"the call with replica {replica}'s worker {sig.name}ed")
        assert _versions(result) == {version}
        lost_at = time.monotonic()
        assert backend.fleet.wait_settled(SETTLE_S)
        metrics = backend.get_logger_metrics()
        assert metrics["fleet_replicas_serving"] == 2
        assert backend.replicas.infos[replica]["pid"] != pid
        print(
            f"\n{sig.name}: the call took {wall_s:.1f} s ({clean_s:.1f} s without the fault); "
            f"full fleet {time.monotonic() - lost_at:.1f} s after the call returned "
            f"(heal {metrics['fleet_heal_seconds_last']:.1f} s from loss to admission); "
            f"{metrics['fleet_rows_rerun_total']} rows re-run so far"
        )
    # the replacements serve the fleet's weights, not the checkpoint's
    again = backend.generate(batch, greedy=True)
    compare_generations(
        reference, again, logprob_atol=tolerance.logprob_atol, near_tie=tolerance.near_tie
    ).assert_ok("after healing")
    newer = refit(backend, _moved(tiny_qwen2, 2))
    after = backend.generate(pad_prompts(PROMPTS * 2, "left"), greedy=True)
    assert _versions(after) == {newer}
    metrics = backend.get_logger_metrics()
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == newer
    assert metrics["fleet_restarts_total"] == 2 and metrics["fleet_faults_total"] == 2

    killing = KillBeforeCommit(backend, 0, settle_s=SETTLE_S)
    newest = refit(killing, _moved(tiny_qwen2, 3))
    assert killing.killed is not None and newest == newer + 1
    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == newest
    assert metrics["fleet_restarts_total"] == 3 and metrics["fleet_faults_total"] == 3
    last = backend.generate(pad_prompts(PROMPTS * 2, "left"), greedy=True)
    assert _versions(last) == {newest}
    # the 32 rows spread over both replicas: each prompt's two copies agree wherever they ran
    compare_generations(
        last.select_indices(list(range(len(PROMPTS)))),
        last.select_indices(list(range(len(PROMPTS), 2 * len(PROMPTS)))),
        logprob_atol=tolerance.logprob_atol,
        near_tie=tolerance.near_tie,
    ).assert_ok("the survivor's rows and the replacement's, after a kill in a refit")

    # a replacement killed in its own load: another follows, from the survivor's copy
    loads = KillDuringLoad(backend.fleet)
    os.kill(backend.replicas.infos[1]["pid"], signal.SIGKILL)
    _wait_metric(backend, "fleet_restarts_total", 5)  # the loss seen, the load killed, again
    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert loads.killed is not None
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_faults_total"] == 4
    assert metrics["fleet_restarts_total"] == 5  # the killed replacement and the next
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == newest
    compare_generations(
        last,
        backend.generate(pad_prompts(PROMPTS * 2, "left"), greedy=True),
        logprob_atol=tolerance.logprob_atol,
        near_tie=tolerance.near_tie,
    ).assert_ok("after a replacement was killed in its load")

    # every replica killed mid-call: a typed error within seconds, then the next refit heals
    thread_out: dict = {}
    call = threading.Thread(target=_call_into, args=(thread_out, backend, batch))
    call.start()
    _wait_busy(backend)
    killed_at = time.monotonic()
    for info in backend.replicas.infos:
        os.kill(info["pid"], signal.SIGKILL)
    call.join(timeout=60)
    assert isinstance(thread_out.get("error"), NoReplicaServingError), thread_out
    assert thread_out["at"] - killed_at < 10
    started = time.monotonic()
    with pytest.raises(NoReplicaServingError):
        backend.generate(batch, greedy=True)
    assert time.monotonic() - started < 5
    assert backend.fleet.wait_settled(SETTLE_S)  # both up, waiting for the next refit
    final = refit(backend, _moved(tiny_qwen2, 4))
    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == final
    assert _versions(backend.generate(pad_prompts(PROMPTS * 2, "left"), greedy=True)) == {final}


def _call_into(out: dict, backend, batch) -> None:
    try:
        out["value"] = backend.generate(batch, greedy=True)
    except BaseException as exc:
        out["error"] = exc
    out["at"] = time.monotonic()


def _wait_busy(backend, timeout_s: float = 30) -> None:
    """Until some replica's engine holds rows."""
    deadline = time.monotonic() + timeout_s
    while not any(backend.rows_in_flight()):
        assert time.monotonic() < deadline, "no replica ever held rows"
        time.sleep(0.02)


def _wait_metric(backend, key: str, value: int, timeout_s: float = SETTLE_S) -> None:
    """Until ``get_logger_metrics()[key]`` reaches ``value``."""
    deadline = time.monotonic() + timeout_s
    while backend.get_logger_metrics()[key] < value:
        assert time.monotonic() < deadline, f"{key} stayed below {value}"
        time.sleep(0.1)
