"""A node lost under a healing fleet, on Ray's multi-node test cluster (``ray.cluster_utils``).

Three worker nodes of one CPU each and a head without CPUs, as separate raylets on one machine;
a fleet of two replicas of the fake engine (``fake_vllm_engine.py``), one placement entry per
node, so the third node is the only room left. After a refit (the weights served are on no disk),
a call runs, and the node of a replica holding its rows is removed: its raylet and every process
on it stop, as when a machine is lost. The test shows:

- the call returns every row equal to the fault-free call on the same weights, each token at
  that weight version, and no row is lost;
- Ray places the lost replica's group again on the spare node, the replacement starts there,
  takes the fleet's weights from the surviving peer's copy relayed across nodes (shared memory
  reaches only its own node; ``fleet_copies_relayed_total``), verified, and is admitted: the
  fleet is back to two serving replicas at the fleet's version;
- a later refit reaches both replicas: each scores a sequence exactly as the other does, and
  every row carries the new version;
- no process of the simulated cluster is left afterwards.

The scenario runs in a subprocess (this file, run as a script; ``simulated_cluster``).
"""

from __future__ import annotations

import random
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

WORKER_NODES = 3
PROMPTS = [[3 + i % 50, 17, 42 + i % 7, 8] for i in range(8)]
WEDGE_S = 10.0
#: Four raylets, three fake engines, a replacement, shutdown, on a busy 2-core machine.
SCENARIO_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def report(tiny_qwen2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the scenario saw."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("node_loss")
    started = time.monotonic()
    seen = scenario_report(__file__, tiny_qwen2.path, work, SCENARIO_TIMEOUT_S)
    print(
        f"\nnode-loss scenario: {time.monotonic() - started:.1f} s; the faulty call took "
        f"{seen['call_s']:.2f} s against {seen['clean_s']:.2f} s without the fault; node lost "
        f"to a full fleet {seen['heal_s']:.1f} s; {seen['metrics']}"
    )
    return seen


def test_the_call_returns_what_a_fault_free_call_does(report: dict[str, Any]) -> None:
    assert report["call_returned"]
    assert report["outputs_equal"] and report["logprobs_equal"]
    assert report["call_versions"] == [report["version_1"]]
    assert report["metrics"]["fleet_rows_lost_total"] == 0
    assert report["metrics"]["fleet_rows_rerun_total"] > 0  # the lost node held rows


def test_the_replacement_runs_on_the_spare_node_with_the_relayed_weights(
    report: dict[str, Any],
) -> None:
    before, after, lost = report["nodes_before"], report["nodes_after"], report["removed_node"]
    spare = (set(report["worker_nodes"]) - set(before)).pop()
    assert lost in before and lost not in after
    assert sorted(after) == sorted([n for n in before if n != lost] + [spare])
    metrics = report["metrics"]
    assert report["settled"]
    assert metrics["fleet_replicas_serving"] == 2
    assert metrics["fleet_faults_total"] == 1 and metrics["fleet_restarts_total"] == 1
    assert metrics["fleet_copies_relayed_total"] == 1
    assert report["replica_versions_after_heal"] == [report["version_1"]] * 2


def test_a_later_refit_reaches_both_replicas(report: dict[str, Any]) -> None:
    assert report["version_2"] > report["version_1"]
    assert report["versions_after_refit"] == [report["version_2"]]
    assert report["replica_versions_after_refit"] == [report["version_2"]] * 2
    first, second = report["replica_scores"]
    assert first == second  # the same weights, bit for bit
    assert report["scores_moved"]  # and not the old ones


def test_nothing_of_the_simulated_cluster_is_left(report: dict[str, Any]) -> None:
    assert not any(report["nodes_alive_after_shutdown"])
    assert_exited(report["pids"])


# ---- the scenario (its own process) ------------------------------------------------------------


def _scenario(model_dir: str, log_dir: str) -> dict[str, Any]:
    """Start the simulated cluster and a fleet on it, lose a node mid-call, heal, refit."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    seen: dict[str, Any] = {}
    with simulated_nodes(WORKER_NODES, seen) as (cluster, nodes):
        seen["worker_nodes"] = [node.node_id for node in nodes[1:]]
        _on_fleet(cluster, model_dir, log_dir, seen)
    return seen


def _on_fleet(cluster: Any, model_dir: str, log_dir: str, seen: dict[str, Any]) -> None:
    import torch
    from gen_interface.weights import refit
    from gen_testkit.strategies import pad_prompts
    from refit_faults import perturbed_weights
    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    placement, backend = healing_fleet(cluster, model_dir, log_dir, 2, wedge_s=WEDGE_S, restarts=4)
    pids = {info["pid"] for info in backend.replicas.infos}
    try:
        seen["nodes_before"] = [info["node_id"] for info in backend.replicas.infos]
        seen["version_1"] = refit(backend, perturbed_weights(checkpoint, 1))
        batch = pad_prompts(PROMPTS, "left")
        started = time.monotonic()
        reference = backend.generate(batch)
        seen["clean_s"] = time.monotonic() - started

        out: dict[str, Any] = {}
        call = threading.Thread(target=lambda: out.update(result=backend.generate(batch)))
        started = time.monotonic()
        call.start()
        victim = busy_replica(backend, call, random.Random(0))
        assert victim is not None, "the call ended before a replica held its rows"
        lost_at = time.monotonic()
        seen["removed_node"] = remove_node_of(cluster, backend, victim)
        call.join(timeout=180)
        seen["call_s"] = time.monotonic() - started
        seen["call_returned"] = "result" in out
        result = out["result"]
        seen["outputs_equal"] = torch.equal(result["output_ids"], reference["output_ids"])
        seen["logprobs_equal"] = torch.equal(result["logprobs"], reference["logprobs"])
        seen["call_versions"] = sorted(set(result["weight_versions"][:, 4:].flatten().tolist()))

        seen["settled"] = backend.fleet.wait_settled(240)
        seen["heal_s"] = time.monotonic() - lost_at
        pids |= {info["pid"] for info in backend.replicas.infos}
        seen["nodes_after"] = [info["node_id"] for info in backend.replicas.infos]
        seen["replica_versions_after_heal"] = _replica_versions(backend)
        seen["metrics"] = {
            key: value
            for key, value in backend.get_logger_metrics().items()
            if key.startswith("fleet_")
        }

        sequence = PROMPTS[0] + reference["output_ids"][0, 4:12].tolist()
        before = _scores(backend.replicas.actors[:1], sequence)[0]
        seen["version_2"] = refit(backend, perturbed_weights(checkpoint, 2))
        after = backend.generate(batch)
        seen["versions_after_refit"] = sorted(
            set(after["weight_versions"][:, 4:].flatten().tolist())
        )
        seen["replica_versions_after_refit"] = _replica_versions(backend)
        seen["replica_scores"] = _scores(backend.replicas.actors, sequence)
        seen["scores_moved"] = seen["replica_scores"][0] != before
    finally:
        backend.shutdown()
        placement.shutdown()
        seen["pids"] = sorted(pids)


def _replica_versions(backend: Any) -> list[int]:
    metrics = backend.get_logger_metrics()
    return [int(metrics[f"replica_{i}_weight_version"]) for i in range(2)]


def _scores(actors: list[Any], sequence: list[int]) -> list[list[float]]:
    """Each actor's logprobs of ``sequence`` past its 4-token prompt, asked of it directly."""
    import ray

    rows = ray.get([actor.score.remote([sequence], [4]) for actor in actors], timeout=120)
    return [replica_rows[0]["logprobs"] for replica_rows in rows]


if __name__ == "__main__":
    run_as_scenario(_scenario)
