"""A fleet that heals, on the fake engine through the real backend: a worker killed or wedged
mid-call costs its rows a re-run (the call returns what a fault-free call returns), the fleet
gets back to full size at the fleet's weights (not the checkpoint's), a later refit reaches
every replica; a replica killed during a refit misses it and its replacement joins at the new
version; a replacement killed during its own weight load is replaced again; with no replica
left, calls fail at once with a typed error; fail-stop stays as it was when chosen."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest
import torch
from fake_vllm_engine import read_events, set_fault
from gen_interface import GenerationError, NoReplicaServingError, RowLostError
from gen_interface.weights import WeightBroadcaster, refit
from gen_testkit.strategies import pad_prompts, score_batch
from gen_vllm.refit import weights_differ
from processes import running, wait_dead
from refit_faults import KillBeforeCommit

#: Rows long enough that a fault lands while they run: 12 rows of 48 sampled tokens.
PROMPTS = [[5 + i, 17, 42 + i, 8] for i in range(12)]
SETTLE_S = 240  # a replacement's start on two busy cores (more when the machine pauses us)


def _long(backend):
    return backend.with_sampling(max_new_tokens=48, stop_token_ids=[])


def _generate(backend):
    return _long(backend).generate(pad_prompts(PROMPTS, "left"), greedy=False)


def _same(a, b) -> None:
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert torch.equal(a["logprobs"], b["logprobs"])
    assert torch.equal(a["generation_lengths"], b["generation_lengths"])


def _in_thread(work):
    out: dict = {}

    def run():
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_until(check, what: str, timeout_s: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.05)


def _weight_reports(backend) -> list:
    import ray

    return ray.get([actor.weight_report.remote() for actor in backend.replicas.actors])


def _wait_rows(backend, replica: int, timeout_s: float = 30) -> None:
    """Until ``replica``'s engine holds rows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        members = backend.replicas.member_ids()
        counts = dict(zip(members, backend.rows_in_flight()))
        if counts.get(replica, 0) > 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"replica {replica} never held rows")


@pytest.fixture(scope="module")
def new_weights(tiny_qwen2):
    def draw(seed: int):
        generator = torch.Generator().manual_seed(seed)
        return {
            name: t + 0.3 * t.float().std() * torch.randn(t.shape, generator=generator)
            for name, t in tiny_qwen2.state_dict().items()
        }

    return draw


def test_a_worker_killed_mid_call_costs_a_re_run_and_the_fleet_heals_at_the_fleet_s_weights(
    own, tiny_qwen2, new_weights
):
    """After a refit (the weights are on no disk), replica 0's worker is SIGKILLed while the
    call's rows run: the call returns every row as the fault-free call did, at the same
    version; the replacement takes the fleet's weights from a peer's copy, verifies, serves;
    the next refit reaches both replicas."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, weight_deltas=True)
    version = refit(backend, new_weights(1))
    reference = _generate(backend)
    assert set(reference["weight_versions"][:, 4:].flatten().tolist()) == {version}
    pid = backend.replicas.infos[0]["pid"]

    thread, out = _in_thread(lambda: _generate(backend))
    _wait_rows(backend, 0)
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=120)
    assert "error" not in out, out.get("error")
    _same(out["value"], reference)  # rows re-run elsewhere from their prompts and seeds
    assert set(out["value"]["weight_versions"][:, 4:].flatten().tolist()) == {version}
    assert wait_dead(pid)

    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_restarts_total"] == 1
    assert metrics["fleet_faults_total"] == 1 and metrics["fleet_rows_rerun_total"] >= 1
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == version
    assert backend.replicas.infos[0]["pid"] != pid
    # the replacement serves the fleet's weights: both replicas give the reference's rows
    _same(_generate(backend), reference)

    newer = refit(backend, new_weights(2))
    after = _long(backend).generate(pad_prompts(PROMPTS * 2, "left"), greedy=True)
    assert set(after["weight_versions"][:, 4:].flatten().tolist()) == {newer}
    metrics = backend.get_logger_metrics()
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == newer
    assert backend.rows_in_flight() == [0, 0]


def test_a_replica_killed_during_a_refit_misses_it_and_its_replacement_joins_at_the_new_version(
    own, tiny_qwen2, new_weights
):
    """Replica 0's worker dies after the loads, before the commit: the refit commits on the
    survivor; the replacement, up while the update is open, waits for it and takes the new
    version from the survivor's copy (not the version of before, nor the checkpoint), verified
    equal; every row of a later call carries the new version."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, weight_deltas=True)
    before = refit(backend, new_weights(4))
    _generate(backend)  # the replicas' streams are read from a first call on: a death is seen
    killing = KillBeforeCommit(backend, 0, settle_s=SETTLE_S)
    version = refit(killing, new_weights(5))
    assert killing.killed is not None and version == before + 1
    assert backend.get_logger_metrics()["replica_1_weight_version"] == version
    reference = _generate(backend)
    assert set(reference["weight_versions"][:, 4:].flatten().tolist()) == {version}

    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_restarts_total"] == 1
    assert metrics["fleet_faults_total"] == 1
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == version
    assert backend.replicas.infos[0]["pid"] != killing.killed
    replacement, survivor = _weight_reports(backend)
    assert weights_differ(survivor, replacement) is None
    _same(_generate(backend), reference)
    after = _long(backend).generate(pad_prompts(PROMPTS * 2, "left"), greedy=True)
    assert set(after["weight_versions"][:, 4:].flatten().tolist()) == {version}
    assert backend.rows_in_flight() == [0, 0]


def test_the_collective_path_forms_its_group_again_when_the_fleet_s_workers_change(
    own, tiny_qwen2, new_weights
):
    """A weight group's ranks are fixed when it forms. After replica 0 is replaced (same size,
    one member gone), the backend says the group is no longer intact, so the group is formed
    again with the workers of now before the refit, which takes far less than the broadcast
    timeout it would wait on the dead member. While replica 1 is dead and not yet replaced
    (fewer workers), the group is formed again before the refit, which commits on the survivor;
    its replacement then loads that version from the survivor's copy."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, weight_deltas=True)
    broadcaster = WeightBroadcaster.connect(backend, host="127.0.0.1", timeout_s=60)
    try:
        first = broadcaster.refit(new_weights(1))
        pid = backend.replicas.infos[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_dead(pid)
        _wait_until(lambda: backend.fleet.health.restarts >= 1, "the loss")
        assert backend.fleet.wait_settled(SETTLE_S)
        assert not backend.collective_intact()
        started = time.monotonic()
        second = broadcaster.refit(new_weights(2))
        assert time.monotonic() - started < 30  # the broadcast timeout is 60 s
        assert second > first and broadcaster.rejoins == 1
        assert backend.collective_intact()
        rows = _long(backend).generate(pad_prompts(PROMPTS, "left"), greedy=True)
        assert set(rows["weight_versions"][:, 4:].flatten().tolist()) == {second}

        pid = backend.replicas.infos[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: backend.replicas.member_ids() == [0], "replica 1's loss")
        third = broadcaster.refit(new_weights(3))  # on the survivor alone
        assert third > second and broadcaster.rejoins == 2
        assert backend.fleet.wait_settled(SETTLE_S)
        metrics = backend.get_logger_metrics()
        assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == third
        rows = _long(backend).generate(pad_prompts(PROMPTS, "left"), greedy=True)
        assert set(rows["weight_versions"][:, 4:].flatten().tolist()) == {third}
    finally:
        broadcaster.close()


def test_a_replacement_killed_during_its_weight_load_is_replaced_again(
    own, tiny_qwen2, new_weights
):
    """After a refit, replica 0 dies; its replacement's load of the fleet's weights stalls and
    its worker is SIGKILLed there: a second replacement follows (two restarts counted) and the
    fleet ends full at the fleet's version, serving what it served before."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, weight_deltas=True)
    version = refit(backend, new_weights(6))
    reference = _generate(backend)
    first = {info["pid"] for info in backend.replicas.infos}

    set_fault(own.log_dir, "load")  # every load stalls now: only a replacement's comes
    os.kill(backend.replicas.infos[0]["pid"], signal.SIGKILL)
    loading: list[int] = []

    def replacement_loading() -> bool:
        events = read_events(own.log_dir)
        loading[:] = [e["pid"] for e in events if e["event"] == "update" and e["pid"] not in first]
        return bool(loading)

    _wait_until(replacement_loading, "a replacement's weight load")
    os.kill(loading[0], signal.SIGKILL)
    assert wait_dead(loading[0])
    set_fault(own.log_dir, "load", on=False)

    _wait_until(
        lambda: backend.get_logger_metrics()["fleet_restarts_total"] == 2, "a second replacement"
    )
    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_faults_total"] == 1
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == version
    assert backend.replicas.infos[0]["pid"] not in first | {loading[0]}
    reports = _weight_reports(backend)
    assert weights_differ(reports[1], reports[0]) is None
    _same(_generate(backend), reference)


def test_a_wedged_replica_is_killed_within_the_bound_and_its_rows_run_elsewhere(own, tiny_qwen2):
    backend = own.backend(own.cluster([2]), tiny_qwen2, wedge_timeout_s=2.0)
    reference = _generate(backend)
    pid = backend.replicas.infos[1]["pid"]
    thread, out = _in_thread(lambda: _generate(backend))
    _wait_rows(backend, 1)
    set_fault(own.log_dir, "wedge", pid=pid)  # alive, answering Ray, never stepping again
    wedged_at = time.monotonic()
    thread.join(timeout=60)
    assert "error" not in out, out.get("error")
    _same(out["value"], reference)
    assert out["at"] - wedged_at < 2.0 + 8.0  # the bound, the checks' period and the re-run
    assert wait_dead(pid, 10)  # killed, never left half-alive
    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_faults_total"] == 1
    _same(_generate(backend), reference)


def test_with_every_replica_killed_calls_fail_at_once_with_a_typed_error_then_the_fleet_heals(
    own, tiny_qwen2
):
    backend = own.backend(own.cluster([2]), tiny_qwen2)
    reference = _generate(backend)
    pids = [info["pid"] for info in backend.replicas.infos]
    thread, out = _in_thread(lambda: _generate(backend))
    _wait_rows(backend, 0)
    killed_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert isinstance(out.get("error"), NoReplicaServingError), out
    assert out["at"] - killed_at < 10
    started = time.monotonic()
    with pytest.raises(NoReplicaServingError, match="no replica of the fleet serves"):
        _generate(backend)  # replacements starting: refused at once, not hung
    assert time.monotonic() - started < 5
    # nothing is broken for good: the replacements take the checkpoint's weights (no update
    # committed yet) and verify against each other's
    assert backend.fleet.wait_settled(SETTLE_S)
    assert backend.get_logger_metrics()["fleet_replicas_serving"] == 2
    _same(_generate(backend), reference)


def test_past_max_replica_restarts_the_fleet_runs_smaller_and_says_so(own, tiny_qwen2, caplog):
    backend = own.backend(own.cluster([2]), tiny_qwen2, max_replica_restarts=0)
    reference = _generate(backend)
    pid = backend.replicas.infos[0]["pid"]
    thread, out = _in_thread(lambda: _generate(backend))
    _wait_rows(backend, 0)
    with caplog.at_level(logging.WARNING, logger="gen_backend_kit.fleet_health"):
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=60)
    _same(out["value"], reference)
    assert any("runs with 1 of 2 replicas" in r.getMessage() for r in caplog.records)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 1 and metrics["fleet_replicas_dead"] == 1
    assert metrics["replica_0_state"] == 2  # ReplicaState.DEAD
    assert backend.rows_in_flight() == [0]  # only the member is asked
    _same(_generate(backend), reference)


def test_without_a_copy_of_the_committed_weights_a_replacement_joins_the_next_refit(
    own, tiny_qwen2, new_weights, caplog
):
    """The replacement would serve the checkpoint, versions old: it is never admitted with it.
    It waits, stale and routed no rows, until the next refit loads into it as into the
    members, and is admitted at that refit's commit, its weights verified equal."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, max_replica_restarts=2)
    refit(backend, new_weights(3))
    reference = _generate(backend)
    pid = backend.replicas.infos[1]["pid"]
    thread, out = _in_thread(lambda: _generate(backend))
    _wait_rows(backend, 1)
    with caplog.at_level(logging.WARNING):
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=60)
        _same(out["value"], reference)
        _wait_until(lambda: backend.fleet.joining() == [1], "the replacement waiting to join")
    assert backend.fleet.wait_settled(SETTLE_S)  # waiting on a refit is not under way
    assert any("joins the next weight update" in r.getMessage() for r in caplog.records)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 1 and metrics["fleet_replicas_stale"] == 1
    _same(_generate(backend), reference)  # served by the member alone
    assert backend.collective_ranks() == 2  # the joining replica takes the next update
    version = refit(backend, new_weights(4))
    assert backend.fleet.joining() == []
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_restarts_total"] == 1
    assert metrics["replica_1_weight_version"] == version
    reports = _weight_reports(backend)
    assert weights_differ(reports[0], reports[1]) is None
    after = _generate(backend)
    assert not torch.equal(after["output_ids"], reference["output_ids"])
    assert set(after["weight_version"].tolist()) == {version}
    _same(_generate(backend), after)  # rows on either replica agree


def test_with_every_replica_lost_after_a_refit_the_next_refit_brings_the_whole_fleet_back(
    own, tiny_qwen2, new_weights
):
    """No copy of the committed weights outlived the replicas: both replacements wait to join,
    calls are refused with a typed error, and the next refit, which has no serving replica to
    compare with, verifies the joiners against each other and admits both at its version."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, weight_deltas=True)
    refit(backend, new_weights(7))
    for info in backend.replicas.infos:
        os.kill(info["pid"], signal.SIGKILL)
    _wait_until(lambda: backend.fleet.joining() == [0, 1], "both replacements waiting to join")
    with pytest.raises(NoReplicaServingError):
        _generate(backend)
    version = refit(backend, new_weights(8))
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and backend.fleet.joining() == []
    assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == version
    reports = _weight_reports(backend)
    assert weights_differ(reports[0], reports[1]) is None
    rows = _generate(backend)
    assert set(rows["weight_version"].tolist()) == {version}
    _same(_generate(backend), rows)  # rows on either replica agree


def test_a_row_that_already_streamed_tokens_gets_a_typed_retryable_error_naming_it(own, tiny_qwen2):
    backend = own.backend(own.cluster([2]), tiny_qwen2)
    view = backend.with_sampling(max_new_tokens=200, stop_token_ids=[])
    pids = [info["pid"] for info in backend.replicas.infos]
    seen: dict[int, list[int]] = {}

    async def stream() -> None:
        async for event in view.generate_stream(pad_prompts([[5, 6, 7], [9, 9]], "left")):
            seen.setdefault(event.index, []).extend(event.token_ids)
            # both rows (one per replica) have streamed tokens: replica 0's row is then lost,
            # whichever of the two the router gave it (on a busy machine one row may start late)
            if len(seen) == 2 and all(seen.values()) and running(pids[0]):
                os.kill(pids[0], signal.SIGKILL)

    with pytest.raises(RowLostError, match=r"row\(s\) \[[01]\].*run those rows again") as caught:
        asyncio.run(stream())
    assert caught.value.rows in ((0,), (1,)) and caught.value.retryable
    assert backend.get_logger_metrics()["fleet_rows_lost_total"] == 1
    assert backend.fleet.wait_settled(SETTLE_S)
    again = view.with_sampling(max_new_tokens=8).generate(pad_prompts([[5, 6, 7]], "left"))
    assert again.size == 1  # the backend is usable: the caller retries the row


def test_a_replica_dead_before_score_is_evicted_and_its_shard_scored_elsewhere(own, tiny_qwen2):
    backend = own.backend(own.cluster([2]), tiny_qwen2)
    sequences = [[5, 17, 42, 8, 9, 10 + i] for i in range(4)] + [[7, 7, 3, 2 + i] for i in range(4)]
    batch = score_batch(sequences, [3] * 8)
    reference = backend.score(batch)
    pid = backend.replicas.infos[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_dead(pid)
    scored = backend.score(batch)
    assert torch.equal(scored, reference)
    assert backend.fleet.wait_settled(SETTLE_S)
    assert backend.get_logger_metrics()["fleet_faults_total"] == 1


def test_fail_stop_when_chosen_breaks_the_backend_as_before(own, tiny_qwen2):
    backend = own.backend(own.cluster([2]), tiny_qwen2, healing=False)
    assert backend.fleet is None
    pid = backend.replicas.infos[0]["pid"]
    thread, out = _in_thread(lambda: _generate(backend))
    _wait_rows(backend, 0)
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert isinstance(out.get("error"), GenerationError) and "died" in str(out["error"])
    with pytest.raises(GenerationError, match="broken"):
        _generate(backend)
    assert "fleet_epoch" not in backend.get_logger_metrics()


def test_a_replica_that_dies_while_idle_is_seen_within_seconds_and_replaced(own, tiny_qwen2):
    """No call has run: the fleet reads every replica's stream from its start, so a worker
    killed while it holds no rows is lost (and replaced) without waiting for a call."""
    backend = own.backend(own.cluster([2]), tiny_qwen2)
    pid = backend.replicas.infos[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_dead(pid)
    deadline = time.monotonic() + 30
    while backend.get_logger_metrics()["fleet_faults_total"] < 1:
        assert time.monotonic() < deadline, "an idle replica's death went unseen for 30 s"
        time.sleep(0.1)
    assert backend.fleet.wait_settled(SETTLE_S)
    metrics = backend.get_logger_metrics()
    assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_restarts_total"] == 1
    assert backend.replicas.infos[0]["pid"] != pid
    _generate(backend)  # both serve
