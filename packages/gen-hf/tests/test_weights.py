"""Weight updates beyond what the conformance suite checks: in-process state dicts, subsets,
updates while finished, refit info, and updates after shutdown."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_interface import (
    BatchedDataDict,
    WeightsAbsentError,
    WeightUpdateError,
    configure_generation_config,
)
from gen_interface.weights import refit, share_weights
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7, 7, 7, 7], [300, 12]]


@pytest.fixture(scope="module")
def backend(tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]) -> Iterator[HfGeneration]:
    backend = HfGeneration(make_config(tiny_qwen2, stop_token_ids=[]))
    yield backend
    backend.shutdown()


@pytest.fixture
def original(tiny_qwen2: TinyModel, backend: HfGeneration) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's weights; put back after each test whatever the test did."""
    weights = tiny_qwen2.state_dict()
    yield weights
    backend.prepare_for_generation()
    backend.update_weights_from_state_dict(weights)


def greedy(backend: HfGeneration) -> BatchedDataDict[Any]:
    return backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)


def scaled(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {name: tensor * factor for name, tensor in weights.items()}


def assert_same(a: BatchedDataDict[Any], b: BatchedDataDict[Any]) -> None:
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert torch.equal(a["logprobs"], b["logprobs"])


def assert_changed(a: BatchedDataDict[Any], b: BatchedDataDict[Any]) -> None:
    assert not torch.equal(a["output_ids"], b["output_ids"]) or not torch.equal(
        a["logprobs"], b["logprobs"]
    ), "outputs did not change after a weight update"


def test_state_dict_update_changes_outputs_and_restores_exactly(
    backend: HfGeneration, original: dict[str, torch.Tensor]
):
    before = greedy(backend)
    noise = torch.Generator().manual_seed(3)
    perturbed = {
        name: t + 0.05 * torch.randn(t.shape, generator=noise) for name, t in original.items()
    }
    backend.update_weights_from_state_dict(perturbed)
    assert_changed(before, greedy(backend))
    assert all(torch.equal(backend.state_dict()[n], perturbed[n]) for n in perturbed)
    backend.update_weights_from_state_dict(original)
    assert_same(before, greedy(backend))


def test_a_subset_of_the_weights_is_refused_as_in_every_backend(
    backend: HfGeneration, original: dict[str, torch.Tensor]
):
    """Only ``lm_head.weight`` travels: refused (every weight must), nothing written."""
    before = greedy(backend)
    with (
        share_weights({"lm_head.weight": original["lm_head.weight"].flip(0)}) as shared,
        pytest.raises(WeightUpdateError, match=r"missing .*nothing|nothing was written.*missing"),
    ):
        backend.update_weights_from_ipc_handles(shared.handles)
    assert_same(before, greedy(backend))


@pytest.mark.parametrize(
    "fault", ["wrong shape", "unknown name", "non-float dtype", "not a tensor", "missing"]
)
def test_mismatched_state_dict_update_is_refused_and_changes_nothing(
    backend: HfGeneration, original: dict[str, torch.Tensor], fault: str
):
    before = greedy(backend)
    bad: dict[str, Any] = scaled(original, 1.5)
    name = "model.norm.weight"
    if fault == "wrong shape":
        bad[name] = torch.ones(7)
    elif fault == "unknown name":
        bad["model.layers.99.mlp.up_proj.weight"] = torch.ones(3)
    elif fault == "non-float dtype":
        bad[name] = bad[name].to(torch.int64)
    elif fault == "missing":
        del bad[name]
    else:
        bad[name] = bad[name].tolist()
    with pytest.raises(WeightUpdateError, match="nothing was written"):
        backend.update_weights_from_state_dict(bad)
    assert_same(before, greedy(backend))


def test_prepare_refit_info_checks_names_and_shapes(
    backend: HfGeneration, original: dict[str, torch.Tensor]
):
    backend.prepare_refit_info({n: (t.shape, t.dtype) for n, t in original.items()})
    with pytest.raises(WeightUpdateError, match=r"lm_head\.weight"):
        backend.prepare_refit_info({"lm_head.weight": (torch.Size([3, 3]), torch.float32)})


def test_update_while_finished_takes_effect_after_prepare(
    backend: HfGeneration, original: dict[str, torch.Tensor]
):
    """The training loop's order: finish, train, update, prepare, generate."""
    before = greedy(backend)
    backend.finish_generation()
    with share_weights(scaled(original, 1.5)) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    backend.prepare_for_generation()
    changed = greedy(backend)
    assert_changed(before, changed)
    backend.update_weights_from_state_dict(original)
    assert_same(before, greedy(backend))


def test_refused_ipc_update_releases_the_segments(
    backend: HfGeneration, original: dict[str, torch.Tensor]
):
    """A refused update is not retried by anyone else in process: its segments go too."""
    bad = scaled(original, 1.5)
    bad["model.norm.weight"] = torch.ones(7)
    with share_weights(bad) as shared:
        with pytest.raises(WeightUpdateError):
            backend.update_weights_from_ipc_handles(shared.handles)
        locations = [b["location"] for b in shared.handles["buckets"]]
        assert not any(os.path.exists(path) for path in locations)


def test_updates_after_shutdown_are_refused(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    backend = HfGeneration(make_config(tiny_qwen2))
    weights = tiny_qwen2.state_dict()
    backend.shutdown()
    with pytest.raises(WeightUpdateError, match="shut down"):
        backend.update_weights_from_state_dict(weights)
    with share_weights(weights) as shared, pytest.raises(WeightUpdateError, match="shut down"):
        backend.update_weights_from_ipc_handles(shared.handles)


def test_float32_masters_into_a_bfloat16_model_equal_its_own_cast(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    """A bfloat16 backend takes float32 weights, cast on the way: the same model as one that
    loaded the float32 checkpoint as bfloat16."""
    target = HfGeneration(make_config(tiny_qwen2, dtype="bfloat16"))
    fresh = HfGeneration(make_config(tiny_qwen2, dtype="bfloat16"))
    try:
        refit(target, scaled(tiny_qwen2.state_dict(), 1.5))
        refit(target, tiny_qwen2.state_dict())  # float32, as a trainer holds them
        assert {t.dtype for t in target.state_dict().values()} == {torch.bfloat16}
        assert_same(greedy(fresh), greedy(target))
    finally:
        target.shutdown()
        fresh.shutdown()


def test_a_model_built_without_its_checkpoint_generates_only_after_the_first_refit(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], backend: HfGeneration
):
    config = configure_generation_config(
        make_config(tiny_qwen2, stop_token_ids=[]), None, is_eval=False
    )
    unloaded = HfGeneration(config)
    try:
        assert unloaded.config["hf_cfg"]["load_format"] == "dummy"
        with pytest.raises(WeightsAbsentError, match="first weight update"):
            greedy(unloaded)
        version = refit(unloaded, tiny_qwen2.state_dict(), bucket_bytes=64 * 1024)
        out = greedy(unloaded)
        assert_same(out, greedy(backend))
        assert out["weight_version"].tolist() == [version] * len(PROMPTS)
    finally:
        unloaded.shutdown()
