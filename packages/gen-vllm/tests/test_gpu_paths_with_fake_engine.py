"""The CUDA code paths (sleep around refit, tensor parallelism, node layout, failures), run on the
fake engine of ``fake_vllm_engine.py`` through the real ``VllmGeneration`` and its Ray workers.

The session's Ray counts logical GPUs, so clusters here take the GPU branch of every decision
(GPU bundles, sleep mode when colocated, tensor parallelism); the fake refuses what vLLM's CUDA
allocator would (writing or computing on sleeping memory).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import fake_vllm_engine
import pytest
import torch
from fake_vllm_engine import FakeEngineFactory, read_events
from gen_interface import BackendUnavailableError, GenerationError, WeightUpdateError
from gen_interface.weights import share_weights
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1]]


@pytest.fixture(scope="module", autouse=True)
def ship_the_fake_by_value(ray_session):
    """Worker processes cannot import the tests directory: Ray sends the fake's code along."""
    ray_session.cloudpickle.register_pickle_by_value(fake_vllm_engine)
    yield
    ray_session.cloudpickle.unregister_pickle_by_value(fake_vllm_engine)


@pytest.fixture
def clusters(ray_session):
    """Builds GPU clusters (logical GPUs) and removes them after the test."""
    from gen_vllm import RayVirtualCluster

    made = []
    gpus = int(ray_session.cluster_resources().get("GPU", 0))

    def make(bundles, **kwargs):
        if sum(bundles) > gpus:
            pytest.skip(f"needs {sum(bundles)} (logical) GPUs in Ray, it has {gpus}")
        cluster = RayVirtualCluster(bundles, use_gpus=True, num_cpus_per_bundle=1, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.shutdown()


@pytest.fixture
def backends(tmp_path):
    """Builds fake-engine backends, logging to ``tmp_path``; shuts them down after the test."""
    from gen_vllm import VllmGeneration

    made = []

    def make(cluster, model, *, colocated=False, name_prefix="fake", faults=None, **vllm_cfg):
        config = conformance_config(
            backend="vllm",
            model_name=str(model if isinstance(model, (str, Path)) else model.path),
            vocab_size=512,
            colocated={"enabled": colocated},
            vllm_cfg=vllm_cfg,
        )
        backend = VllmGeneration(
            cluster,
            config,
            name_prefix,
            engine_factory=FakeEngineFactory(tmp_path, **(faults or {})),
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.shutdown()


def greedy(backend):
    return backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)


def assert_same(a, b):
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert torch.equal(a["logprobs"], b["logprobs"])


def perturbed(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        name: t + 0.3 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in model.state_dict().items()
    }


def saved_model(model, weights: dict[str, torch.Tensor], where: Path) -> Path:
    """A copy of ``model``'s directory holding ``weights``: what a fresh engine would load."""
    from safetensors.torch import save_file

    shutil.copytree(model.path, where)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(where / "model.safetensors"))
    return where


# ---- 1. refit while asleep -------------------------------------------------------------------


def test_a_refit_while_asleep_gives_what_a_fresh_engine_on_the_new_weights_gives(
    clusters, backends, tiny_qwen2, tmp_path
):
    backend = backends(clusters([1]), tiny_qwen2, colocated=True)
    before = greedy(backend)
    new = perturbed(tiny_qwen2)
    backend.finish_generation()  # colocated on a GPU: sleeps at level 1
    with share_weights(new) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    with pytest.raises(GenerationError, match="after finish_generation"):
        greedy(backend)  # the update woke the weights only; the KV cache still sleeps
    backend.prepare_for_generation()
    after = greedy(backend)
    fresh = backends(
        clusters([1]), saved_model(tiny_qwen2, new, tmp_path / "new"), name_prefix="f2"
    )
    assert_same(after, greedy(fresh))
    assert not torch.equal(after["logprobs"], before["logprobs"])
    events = [
        (e["event"], e.get("tags"))
        for e in read_events(tmp_path)
        if e["pid"] == _pid_of(backend) and e["event"] in ("sleep", "wake_up", "update")
    ]
    assert events == [
        ("sleep", None),
        ("wake_up", ["weights"]),  # the update wakes the weights only ...
        ("update", None),
        ("wake_up", ["kv_cache"]),  # ... and prepare_for_generation the rest
    ]


def test_nemo_rl_refit_order_with_tags_restores_the_outputs(clusters, backends, tiny_qwen2):
    backend = backends(clusters([1]), tiny_qwen2, colocated=True)
    before = greedy(backend)
    with share_weights(perturbed(tiny_qwen2)) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    backend.finish_generation()
    backend.prepare_for_generation(tags=["weights"])
    with share_weights(tiny_qwen2.state_dict()) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    backend.prepare_for_generation(tags=["kv_cache"])
    assert_same(greedy(backend), before)


# ---- 2. tensor parallelism -------------------------------------------------------------------


def test_tensor_parallel_replicas_verify_rank_by_rank(clusters, backends, tiny_qwen2, tmp_path):
    backend = backends(clusters([4]), tiny_qwen2, tensor_parallel_size=2)
    assert backend.num_replicas == 2
    assert all(len(set(ids)) == 2 for ids in backend.device_ids())  # two ranks per engine
    new = perturbed(tiny_qwen2)
    with share_weights(new) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)  # shards differ per rank
    fresh = backends(
        clusters([1]), saved_model(tiny_qwen2, new, tmp_path / "new"), name_prefix="f2"
    )
    assert_same(greedy(backend), greedy(fresh))


def test_a_rank_left_with_wrong_weights_breaks_the_backend(clusters, backends, tiny_qwen2):
    backend = backends(
        clusters([4]), tiny_qwen2, tensor_parallel_size=2, faults={"corrupt_one_load": True}
    )
    with (
        share_weights(perturbed(tiny_qwen2)) as shared,
        pytest.raises(WeightUpdateError, match=r"rank 1 holds different weights.*broken"),
    ):
        backend.update_weights_from_ipc_handles(shared.handles)
    with pytest.raises(GenerationError, match="broken"):
        greedy(backend)


# ---- 4. engines never span nodes: test_multi_node.py, on Ray's simulated multi-node cluster ----


# ---- 5. sleep only when colocated ------------------------------------------------------------


@pytest.mark.parametrize("colocated", [False, True])
def test_engines_sleep_on_finish_only_when_colocated(
    clusters, backends, tiny_qwen2, tmp_path, colocated
):
    backend = backends(clusters([1]), tiny_qwen2, colocated=colocated)
    assert backend.capabilities.sleep == colocated
    before = greedy(backend)
    backend.finish_generation()
    backend.prepare_for_generation()
    assert_same(greedy(backend), before)
    events = [e for e in read_events(tmp_path) if e["event"] in ("sleep", "wake_up")]
    if colocated:
        assert [(e["event"], e.get("level"), e.get("tags")) for e in events] == [
            ("sleep", 1, None),
            ("wake_up", None, ["weights", "kv_cache"]),
        ]
    else:
        assert events == []


# ---- 6. with_sampling front ends share the lifecycle ------------------------------------------


def test_front_ends_share_the_owners_lifecycle(clusters, backends, tiny_qwen2):
    owner = backends(clusters([1]), tiny_qwen2, colocated=True)
    view = owner.with_sampling(max_new_tokens=3)
    owner.finish_generation()
    with pytest.raises(GenerationError, match="after finish_generation"):
        greedy(view)  # would otherwise compute on sleeping memory
    owner.prepare_for_generation()
    assert greedy(view)["generation_lengths"].max() <= 3
    view.shutdown()
    assert greedy(owner).size == len(PROMPTS)
    other = owner.with_sampling(max_new_tokens=2)
    owner.shutdown()
    with pytest.raises(GenerationError, match="shut down"):
        greedy(other)


# ---- 7. failures -----------------------------------------------------------------------------


def test_a_hung_sleep_times_out_and_breaks_the_backend(clusters, backends, tiny_qwen2):
    backend = backends(
        clusters([1]),
        tiny_qwen2,
        colocated=True,
        faults={"hang_in": frozenset({"sleep"})},
        control_timeout_s=2.0,
    )
    started = time.monotonic()
    with pytest.raises(GenerationError, match="did not finish sleep within 2 s"):
        backend.finish_generation()
    assert time.monotonic() - started < 20
    for call in (lambda: greedy(backend), backend.prepare_for_generation):
        with pytest.raises(GenerationError, match="broken"):
            call()


def test_a_hung_update_times_out_and_breaks_the_backend(clusters, backends, tiny_qwen2):
    backend = backends(
        clusters([1]), tiny_qwen2, faults={"hang_in": frozenset({"update"})}, update_timeout_s=2.0
    )
    with (
        share_weights(perturbed(tiny_qwen2)) as shared,
        pytest.raises(WeightUpdateError, match=r"within 2 s.*broken"),
    ):
        backend.update_weights_from_ipc_handles(shared.handles)
    with pytest.raises(GenerationError, match="broken"):
        greedy(backend)


def test_an_actor_name_clash_is_a_typed_error_and_leaks_no_actor(
    clusters, backends, tiny_qwen2, ray_session
):
    cluster = clusters([2], max_colocated_worker_groups=2)
    backends(cluster, tiny_qwen2, name_prefix="same")
    named = set(ray_session.util.list_named_actors())
    with pytest.raises(BackendUnavailableError, match="name_prefix='same'"):
        backends(cluster, tiny_qwen2, name_prefix="same")
    assert set(ray_session.util.list_named_actors()) == named


def _pid_of(backend) -> int:
    return backend.replicas.infos[0]["pid"]


def test_a_worker_killed_mid_transaction_breaks_the_backend(clusters, backends, tiny_qwen2):
    """One replica dies between two loads of a refit: the update fails, no replica is left
    serving half-updated weights, and the backend says it is broken."""
    import os
    import signal

    from gen_interface.weights import refit

    backend = backends(clusters([2]), tiny_qwen2)
    real_update = backend.update_weights_from_ipc_handles
    loads = []

    def kill_before_the_second_load(handles):
        loads.append(handles)
        if len(loads) == 2:
            os.kill(backend.replicas.infos[1]["pid"], signal.SIGKILL)
        real_update(handles)

    backend.update_weights_from_ipc_handles = kill_before_the_second_load
    with pytest.raises(WeightUpdateError, match=r"died.*broken"):
        refit(backend, perturbed(tiny_qwen2), bucket_bytes=200_000)
    assert len(loads) >= 2  # the load after the kill may have been sent before it failed
    with pytest.raises(GenerationError, match="broken"):
        greedy(backend)
