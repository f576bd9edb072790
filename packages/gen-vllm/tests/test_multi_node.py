"""Multi-node placement on Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``).

A head node without GPUs and two worker nodes with logical GPUs run as separate raylets on one
machine. ``RayVirtualCluster`` joins that cluster by ``address=``, and ``VllmGeneration`` runs on
it unchanged, with the fake engine of ``fake_vllm_engine.py`` (the CUDA code paths on logical
GPUs). Every placement fact comes from Ray's own records: the placement group table, and the
node id each worker actor reports from inside its own process. The tests show that:

- each entry of ``bundle_ct_per_node_list`` is reserved on one node, the entries on distinct
  nodes, and only on nodes that have the resources (never on the head, which has no GPUs);
- data-parallel replicas (``tensor_parallel_size=1``) run on the node of their entry, in
  ``engine_groups`` order: with ``[2, 1]``, two replicas on one worker node, one on the other;
- a tensor-parallel engine's ranks hold bundles of one node, the node its actor runs on;
- a layout whose tensor-parallel group would span nodes is refused with
  ``BackendUnavailableError`` before any worker starts;
- ``generate`` and ``score`` through replicas on several nodes give the model's own greedy
  tokens and logprobs (a reference computed here with transformers), and every replica answers;
- the simulated cluster and its worker processes are gone afterwards.

- more entries than nodes that can hold them are refused, not packed onto one node.

The simulated cluster runs in a subprocess (this file, run as a script; ``simulated_cluster``),
once for the module.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from simulated_cluster import (
    assert_exited,
    run_as_scenario,
    scenario_report,
    simulated_nodes,
)


class Layout(NamedTuple):
    """A ``RayVirtualCluster`` tried on the simulated cluster."""

    name: str
    bundles: list[int]  # bundle_ct_per_node_list
    tp: int  # tensor_parallel_size
    engines: bool  # start a VllmGeneration on it (else only reserve the bundles)


#: Logical resources of each simulated worker node. Two GPUs: an entry of two bundles fills a
#: node, so ``[2, 1]`` and ``[2, 2]`` land on two nodes because of the resources, not by luck.
WORKER_NODE = {"num_cpus": 2, "num_gpus": 2}
WORKER_NODES = 2
LAYOUTS = [
    Layout("data_parallel", [2, 1], 1, engines=True),
    Layout("tensor_parallel", [2, 2], 2, engines=True),
    # Reservable; the second engine of two ranks would need a bundle on each node.
    Layout("tp_group_across_nodes", [2, 1], 2, engines=True),
    # Three one-bundle entries, two GPU nodes: "one entry per node" cannot hold.
    Layout("more_entries_than_nodes", [1, 1, 1], 1, engines=False),
]
PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1], [64, 2, 33], [11, 450]]
#: The whole scenario: three raylets, five fake engines, shutdown, on a busy 2-core machine.
SCENARIO_TIMEOUT_S = 360


def _layout(name: str) -> Layout:
    return next(layout for layout in LAYOUTS if layout.name == name)


# ---- the tests (pytest process) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def report(tiny_qwen2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the scenario saw on the simulated cluster, with the model's reference outputs."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    seen = _run_scenario(tiny_qwen2.path, tmp_path_factory.mktemp("multi_node"))
    seen["reference"] = _reference(tiny_qwen2.path, seen["config"])
    return seen


def test_bundles_are_reserved_one_entry_per_node(report: dict[str, Any]) -> None:
    head, workers = report["head"], report["workers"]
    assert len(set(workers)) == WORKER_NODES and head not in workers
    for layout in LAYOUTS:
        if layout.name == "more_entries_than_nodes":
            continue  # refused: see below
        nodes = _entry_nodes(report, layout)
        assert len(set(nodes)) == len(layout.bundles), f"{layout.name}: entries share a node"
        assert set(nodes) <= set(workers), f"{layout.name}: bundles on the GPU-less head"


@pytest.mark.parametrize("name", ["data_parallel", "tensor_parallel"])
def test_replicas_land_on_the_nodes_of_their_entries(report: dict[str, Any], name: str) -> None:
    layout = _layout(name)
    seen = report["layouts"][name]
    assert "refused" not in seen, seen.get("refused")
    # Replica r belongs to the entry engine_groups gives it (entries in order, count // tp
    # engines each), and its actor must run on that entry's node.
    expected = [
        node
        for node, count in zip(_entry_nodes(report, layout), layout.bundles)
        for _ in range(count // layout.tp)
    ]
    replicas = seen["replicas"]
    assert [r["actor_node"] for r in replicas] == expected
    assert len(set(expected)) == WORKER_NODES  # replicas on both simulated worker nodes
    for replica in replicas:
        assert len(replica["ranks"]) == layout.tp
        if layout.tp > 1:  # each rank holds its own bundle, on its engine's actor's node
            ranks = replica["ranks"]
            assert {rank["node"] for rank in ranks} == {replica["actor_node"]}
            assert len({(rank["group"], rank["bundle"]) for rank in ranks}) == layout.tp


def test_a_tensor_parallel_group_across_nodes_is_refused(report: dict[str, Any]) -> None:
    seen = report["layouts"]["tp_group_across_nodes"]
    assert "refused" in seen, "a tensor-parallel group spanning two nodes was accepted"
    assert seen["refused_type"] == "BackendUnavailableError"
    assert "tensor_parallel_size=2" in seen["refused"]
    assert "multiple of 2" in seen["refused"]
    assert seen["actors_started"] == 0


@pytest.mark.parametrize("name", ["data_parallel", "tensor_parallel"])
def test_generation_across_nodes_gives_the_models_outputs(
    report: dict[str, Any], name: str
) -> None:
    seen, reference = report["layouts"][name], report["reference"]
    assert "refused" not in seen, seen.get("refused")
    assert seen["generated"] == reference["generated"]
    for got, want in zip(seen["scores"], reference["scores"], strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    # Each replica, called on its own, scores the first row: every engine on every node works.
    assert len(seen["replica_scores"]) == len(seen["replicas"])
    for got in seen["replica_scores"]:
        assert got == pytest.approx(reference["scores"][0], abs=1e-4)


def test_the_simulated_cluster_is_gone_afterwards(report: dict[str, Any]) -> None:
    assert report["nodes_alive_after_shutdown"] == [False] * (1 + WORKER_NODES)
    assert report["actor_pids"], "no worker was seen"
    assert_exited(report["actor_pids"])


def test_more_entries_than_nodes_are_refused_not_packed_together(report: dict[str, Any]) -> None:
    """Three one-bundle entries on two GPU nodes: the third has no node of its own."""
    seen = report["layouts"][_layout("more_entries_than_nodes").name]
    assert "refused" in seen, "three entries were packed onto two nodes"
    assert seen["refused_type"] == "BackendUnavailableError"
    assert "each entry on a node of its own" in seen["refused"]


def _entry_nodes(report: dict[str, Any], layout: Layout) -> list[str]:
    """The node of each entry of ``layout``, checking that its bundles share that node."""
    bundle_nodes = report["layouts"][layout.name]["bundle_nodes"]
    nodes = []
    for count, on in zip(layout.bundles, bundle_nodes, strict=True):
        assert len(on) == count
        assert len(set(on)) == 1, f"{layout.name}: an entry's bundles span nodes: {on}"
        nodes.append(on[0])
    return nodes


def _run_scenario(model_dir: Path, work: Path) -> dict[str, Any]:
    """Run this file as a script on a simulated cluster of its own; its JSON report."""
    started = time.monotonic()
    seen = scenario_report(__file__, model_dir, work, SCENARIO_TIMEOUT_S)
    seconds = {name: round(layout["seconds"], 1) for name, layout in seen["layouts"].items()}
    print(
        f"multi-node scenario: {time.monotonic() - started:.1f} s (cluster start "
        f"{seen['start_s']:.1f} s, shutdown {seen['shutdown_s']:.1f} s, layouts {seconds})"
    )
    return seen


def _reference(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Greedy continuations (to a stop token or ``max_new_tokens``) and teacher-forced raw
    logprobs of ``PROMPTS``, from the model run by transformers in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stops = set(config["stop_token_ids"])
    generated, scores = [], []
    with torch.inference_mode():
        for prompt in PROMPTS:
            sequence = list(prompt)
            while len(sequence) - len(prompt) < config["max_new_tokens"]:
                token = int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
                sequence.append(token)
                if token in stops:
                    break
            generated.append(sequence[len(prompt) :])
            logits = model(input_ids=torch.tensor([sequence])).logits[0].float()
            logprobs = logits[:-1].log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])
            scores.append(logprobs.squeeze(1)[len(prompt) - 1 :].tolist())
    return {"generated": generated, "scores": scores}


def _scenario(model_dir: str, log_dir: str) -> dict[str, Any]:
    """Start the simulated cluster, try every layout on it, shut it down; what happened."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    seen: dict[str, Any] = {"layouts": {}, "actor_pids": []}
    with simulated_nodes(WORKER_NODES, seen, head_cpus=1, **WORKER_NODE) as (cluster, nodes):
        seen["head"] = cluster.head_node.node_id
        seen["workers"] = [node.node_id for node in nodes[1:]]
        seen["start_s"] = time.monotonic() - started
        for layout in LAYOUTS:
            began = time.monotonic()
            seen["layouts"][layout.name] = _try_layout(
                cluster.address, layout, model_dir, log_dir, seen
            )
            seen["layouts"][layout.name]["seconds"] = time.monotonic() - began
        stopping = time.monotonic()
    seen["shutdown_s"] = time.monotonic() - stopping
    return seen


def _try_layout(
    address: str, layout: Layout, model_dir: str, log_dir: str, seen: dict[str, Any]
) -> dict[str, Any]:
    """Reserve ``layout`` and, when asked, run a ``VllmGeneration`` on it; where things ran."""
    import ray
    from fake_vllm_engine import FakeEngineFactory
    from gen_interface import BackendUnavailableError
    from gen_testkit.conformance import conformance_config
    from gen_vllm import RayVirtualCluster, VllmGeneration

    config = conformance_config(
        backend="vllm",
        model_name=model_dir,
        vocab_size=512,
        vllm_cfg={"tensor_parallel_size": layout.tp},
    )
    seen["config"] = config
    result: dict[str, Any] = {}
    try:
        cluster = RayVirtualCluster(
            layout.bundles,
            use_gpus=True,
            num_cpus_per_bundle=1,
            address=address,
            name=layout.name,
            placement_timeout_s=10 if layout.name == "more_entries_than_nodes" else 60,
        )
    except BackendUnavailableError as exc:
        return {"refused": str(exc), "refused_type": type(exc).__name__, "actors_started": 0}
    try:
        tables = [
            ray.util.placement_group_table(cluster.placement_group(i))
            for i in range(len(layout.bundles))
        ]
        result["bundle_nodes"] = [
            [table["bundles_to_node_id"][b] for b in range(count)]
            for table, count in zip(tables, layout.bundles)
        ]
        if not layout.engines:
            return result
        before = set(ray.util.list_named_actors())
        try:
            backend = VllmGeneration(
                cluster, config, layout.name, engine_factory=FakeEngineFactory(log_dir)
            )
        except BackendUnavailableError as exc:
            result["refused"] = str(exc)
            result["refused_type"] = type(exc).__name__
            result["actors_started"] = len(set(ray.util.list_named_actors()) - before)
            return result
        try:
            seen["actor_pids"] += [info["pid"] for info in backend.replicas.infos]
            result.update(_run_on(backend, tables, result["bundle_nodes"]))
        finally:
            backend.shutdown()
    finally:
        cluster.shutdown()
    return result


def _run_on(
    backend: Any, tables: list[dict[str, Any]], bundle_nodes: list[list[str]]
) -> dict[str, Any]:
    """Where each replica and rank runs; greedy outputs and scores through the backend."""
    import ray
    import torch
    from gen_interface import BatchedDataDict
    from gen_testkit.strategies import pad_prompts

    actors = backend.replicas.actors
    actor_nodes = ray.get([a.__ray_call__.remote(_node_of_actor) for a in actors], timeout=120)
    group_of = {table["placement_group_id"][:8]: i for i, table in enumerate(tables)}
    replicas = [
        {
            "actor_node": node,
            "ranks": [_rank_place(device, group_of, bundle_nodes) for device in ranks],
        }
        for node, ranks in zip(actor_nodes, backend.device_ids())
    ]
    out = backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)
    starts = [len(p) for p in PROMPTS]
    generated = [
        out["output_ids"][i, s : s + int(out["generation_lengths"][i])].tolist()
        for i, s in enumerate(starts)
    ]
    sequences = [p + g for p, g in zip(PROMPTS, generated)]
    width = max(len(s) for s in sequences)
    scored = backend.score(
        BatchedDataDict(
            input_ids=torch.tensor([s + [0] * (width - len(s)) for s in sequences]),
            prompt_lengths=torch.tensor(starts),
            unpadded_sequence_lengths=torch.tensor([len(s) for s in sequences]),
        )
    )
    direct = ray.get([a.score.remote(sequences[:1], starts[:1]) for a in actors], timeout=120)
    return {
        "replicas": replicas,
        "generated": generated,
        "scores": [
            scored[i, s : len(q)].tolist() for i, (s, q) in enumerate(zip(starts, sequences))
        ],
        "replica_scores": [rows[0]["logprobs"] for rows in direct],
    }


def _node_of_actor(actor: object) -> str:
    """Run inside a worker actor: the Ray node its process belongs to."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _rank_place(
    device_id: str, group_of: dict[str, int], bundle_nodes: list[list[str]]
) -> dict[str, Any]:
    """A fake rank's place, from its device id ``GPU-fake-<group>-<bundle or GPU>-r<rank>-<pid>``:
    its placement group, the bundle it holds (tensor parallel), and that bundle's node."""
    _, _, group_id, where, rank, _ = device_id.split("-")
    group = group_of[group_id]
    bundle = int(where) if where.isdigit() else None
    return {
        "rank": int(rank.removeprefix("r")),
        "group": group,
        "bundle": bundle,
        "node": bundle_nodes[group][bundle] if bundle is not None else None,
    }


if __name__ == "__main__":
    run_as_scenario(_scenario)
