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

import pytest
import torch
from fake_vllm_engine import arm_corrupt_load
from gen_interface import BackendUnavailableError, GenerationError, WeightUpdateError
from gen_interface.weights import refit, share_weights
from gen_testkit.strategies import pad_prompts

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1]]


@pytest.fixture(scope="module")
def new_weights(tiny_qwen2):
    return perturbed(tiny_qwen2)


@pytest.fixture(scope="module")
def fresh_on_new_weights(shared, tiny_qwen2, new_weights, tmp_path_factory):
    """A backend started on ``new_weights`` from disk, not colocated: what a refit must match."""
    where = saved_model(tiny_qwen2, new_weights, tmp_path_factory.mktemp("new") / "model")
    return shared.backend(shared.cluster([1]), where, name_prefix="fresh")


@pytest.fixture(scope="module")
def colocated_for_module(shared, tiny_qwen2):
    return shared.backend(shared.cluster([1]), tiny_qwen2, colocated=True, name_prefix="coloc")


@pytest.fixture
def colocated(colocated_for_module, tiny_qwen2):
    """The shared colocated backend, ready and back on the checkpoint's weights after the test."""
    yield colocated_for_module
    colocated_for_module.prepare_for_generation()
    refit(colocated_for_module, tiny_qwen2.state_dict())


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
    shared, colocated, fresh_on_new_weights, new_weights
):
    before = greedy(colocated)
    since = shared.event_count(colocated)
    colocated.finish_generation()  # colocated on a GPU: sleeps at level 1
    with share_weights(new_weights) as handles:
        colocated.update_weights_from_ipc_handles(handles.handles)
    with pytest.raises(GenerationError, match="after finish_generation"):
        greedy(colocated)  # the update woke the weights only; the KV cache still sleeps
    colocated.prepare_for_generation()
    after = greedy(colocated)
    assert_same(after, greedy(fresh_on_new_weights))
    assert not torch.equal(after["logprobs"], before["logprobs"])
    assert shared.events(colocated, since) == [
        ("sleep", 1, None),
        ("wake_up", None, ["weights"]),  # the update wakes the weights only ...
        ("update", None, None),
        ("wake_up", None, ["kv_cache"]),  # ... and prepare_for_generation the rest
    ]


def test_nemo_rl_refit_order_with_tags_restores_the_outputs(colocated, new_weights, tiny_qwen2):
    before = greedy(colocated)
    with share_weights(new_weights) as handles:
        colocated.update_weights_from_ipc_handles(handles.handles)
    colocated.finish_generation()
    colocated.prepare_for_generation(tags=["weights"])
    with share_weights(tiny_qwen2.state_dict()) as handles:
        colocated.update_weights_from_ipc_handles(handles.handles)
    colocated.prepare_for_generation(tags=["kv_cache"])
    assert_same(greedy(colocated), before)


# ---- 2. tensor parallelism -------------------------------------------------------------------


def test_tensor_parallel_replicas_verify_rank_by_rank(
    own, tiny_qwen2, fresh_on_new_weights, new_weights
):
    """An update reaches every rank's own shard and is checked rank by rank: a rank left with
    wrong weights is found, and the backend is then broken."""
    backend = own.backend(own.cluster([4]), tiny_qwen2, tensor_parallel_size=2)
    assert backend.num_replicas == 2
    assert all(len(set(ids)) == 2 for ids in backend.device_ids())  # two ranks per engine
    with share_weights(new_weights) as handles:
        backend.update_weights_from_ipc_handles(handles.handles)  # shards differ per rank
    assert_same(greedy(backend), greedy(fresh_on_new_weights))
    arm_corrupt_load(own.log_dir)  # the next load writes a wrong shard on one engine's rank 1
    with (
        share_weights(tiny_qwen2.state_dict()) as handles,
        pytest.raises(WeightUpdateError, match=r"rank 1 holds different weights.*broken"),
    ):
        backend.update_weights_from_ipc_handles(handles.handles)
    with pytest.raises(GenerationError, match="broken"):
        greedy(backend)


# ---- 4. engines never span nodes: test_multi_node.py, on Ray's simulated multi-node cluster ----


# ---- 5. sleep only when colocated ------------------------------------------------------------


@pytest.mark.parametrize("name", ["colocated", "fresh_on_new_weights"])
def test_engines_sleep_on_finish_only_when_colocated(shared, request, name):
    backend = request.getfixturevalue(name)
    colocated = name == "colocated"
    assert backend.capabilities.sleep == colocated
    before = greedy(backend)
    since = shared.event_count(backend)
    backend.finish_generation()
    backend.prepare_for_generation()
    assert_same(greedy(backend), before)
    events = [e for e in shared.events(backend, since) if e[0] != "update"]
    if colocated:
        assert events == [("sleep", 1, None), ("wake_up", None, ["weights", "kv_cache"])]
    else:
        assert events == []


# ---- 6. with_sampling front ends share the lifecycle ------------------------------------------


def test_front_ends_share_the_owners_lifecycle(colocated):
    view = colocated.with_sampling(max_new_tokens=3)
    colocated.finish_generation()
    with pytest.raises(GenerationError, match="after finish_generation"):
        greedy(view)  # would otherwise compute on sleeping memory
    colocated.prepare_for_generation()
    assert greedy(view)["generation_lengths"].max() <= 3
    view.shutdown()
    with pytest.raises(GenerationError, match="shut down"):
        greedy(view)
    assert greedy(colocated).size == len(PROMPTS)  # closing a front end leaves its owner


def test_front_ends_of_a_shut_down_owner_refuse_to_generate(own, tiny_qwen2):
    owner = own.backend(own.cluster([1]), tiny_qwen2)
    other = owner.with_sampling(max_new_tokens=2)
    owner.shutdown()
    with pytest.raises(GenerationError, match="shut down"):
        greedy(other)


# ---- 7. failures -----------------------------------------------------------------------------


def test_a_hung_sleep_times_out_and_breaks_the_backend(own, tiny_qwen2):
    backend = own.backend(
        own.cluster([1]),
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


def test_a_hung_update_times_out_and_breaks_the_backend(own, tiny_qwen2, new_weights):
    hang = {"hang_in": frozenset({"update"})}
    backend = own.backend(
        own.cluster([1]), tiny_qwen2, faults=hang, update_timeout_s=2.0, healing=False
    )
    with (
        share_weights(new_weights) as handles,
        pytest.raises(WeightUpdateError, match=r"within 2 s.*broken"),
    ):
        backend.update_weights_from_ipc_handles(handles.handles)
    with pytest.raises(GenerationError, match="broken"):
        greedy(backend)


def test_an_actor_name_clash_is_a_typed_error_and_leaks_no_actor(
    own, colocated, tiny_qwen2, ray_session
):
    named = set(ray_session.util.list_named_actors())
    with pytest.raises(BackendUnavailableError, match="name_prefix='coloc'"):
        own.backend(colocated.cluster, tiny_qwen2, name_prefix="coloc")  # the same names
    assert set(ray_session.util.list_named_actors()) == named
    assert greedy(colocated).size == len(PROMPTS)  # the backend that holds the names goes on


@pytest.mark.parametrize("path", ["streamed", "one-shot"])
def test_a_worker_killed_mid_read_leaves_no_segment(own, tiny_qwen2, new_weights, path):
    """The worker dies while it holds a load's handles (its engine reading them): the update
    fails, and no segment of the trainer's or the worker's is left once the trainer lets go of
    its refitter (streamed: the ring is reused until then); one-shot handles, which the
    consumer releases after reading, are released by the backend although the worker died."""
    import gc
    import os
    import signal
    import threading

    from fake_backends import read_events
    from gen_interface.weights import Refitter
    from gen_interface.weights.shm import owner_of, segment_dir

    def segments_of(*pids: int) -> set[str]:
        owners = {p.name: owner_of(p) for p in segment_dir().iterdir()}
        return {name for name, owner in owners.items() if owner and owner[1] in pids}

    earlier = segments_of(os.getpid())
    hang = {"hang_in": frozenset({"update"})}
    backend = own.backend(
        own.cluster([1]), tiny_qwen2, faults=hang, update_timeout_s=120.0, healing=False
    )
    worker = backend.replicas.infos[0]["pid"]
    refitter = Refitter(backend, bucket_bytes=200_000)
    shared = share_weights(new_weights)  # never closed either
    errors: list[BaseException] = []

    def update() -> None:
        try:
            if path == "streamed":
                refitter.refit(new_weights)
            else:
                backend.update_weights_from_ipc_handles(shared.handles)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=update)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(e["event"] == "hang" and e["pid"] == worker for e in read_events(own.log_dir)):
        assert time.monotonic() < deadline, "the worker never took the load"
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    thread.join(120)
    assert len(errors) == 1 and isinstance(errors[0], WeightUpdateError), errors
    held = segments_of(os.getpid()) - earlier
    assert bool(held) == (path == "streamed"), held
    errors.clear()  # the traceback holds the refitter too
    refitter = shared = None  # a trainer that never closes: they go when collected
    gc.collect()
    assert segments_of(os.getpid(), worker) - earlier == set()


def test_a_worker_killed_mid_transaction_breaks_the_backend(own, tiny_qwen2, new_weights):
    """One replica dies between two loads of a refit: the update fails, no replica is left
    serving half-updated weights, and the backend says it is broken."""
    import os
    import signal

    backend = own.backend(own.cluster([2]), tiny_qwen2, healing=False)  # fail-stop, as chosen
    real_update = backend.update_weights_from_ipc_handles
    loads = []

    def kill_before_the_second_load(handles):
        loads.append(handles)
        if len(loads) == 2:
            os.kill(backend.replicas.infos[1]["pid"], signal.SIGKILL)
        real_update(handles)

    backend.update_weights_from_ipc_handles = kill_before_the_second_load
    with pytest.raises(WeightUpdateError, match=r"died.*broken"):
        refit(backend, new_weights, bucket_bytes=200_000)
    assert len(loads) >= 2  # the load after the kill may have been sent before it failed
    with pytest.raises(GenerationError, match="broken"):
        greedy(backend)
