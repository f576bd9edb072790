"""CUDA-only behaviour: the conformance suite on the GPU, colocated finish/prepare moving the
weights off and back, and weight updates through CUDA IPC. Skipped without a CUDA device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_interface import BatchedDataDict, GenerationError
from gen_interface.weights import share_weights
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7, 7, 7, 7], [300, 12]]


class TestHfQwen2Cuda(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_qwen2: TinyModel) -> Iterator[ConformanceSubject]:
        config = conformance_config(
            backend="hf",
            model_name=str(tiny_qwen2.path),
            vocab_size=tiny_qwen2.vocab_size,
            logprobs_mode="processed",
            hf_cfg={"device": "cuda"},
        )
        backend = HfGeneration(cast(HfConfig, config))
        yield ConformanceSubject.for_model(backend, tiny_qwen2)
        backend.shutdown()


def greedy(backend: HfGeneration) -> BatchedDataDict[Any]:
    return backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)


def model_bytes(model: TinyModel) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("colocated", [True, False])
def test_finish_moves_weights_off_the_gpu_only_when_colocated(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], colocated: bool
):
    backend = HfGeneration(
        make_config(tiny_qwen2, colocated={"enabled": colocated}, hf_cfg={"device": "cuda"})
    )
    assert backend.capabilities.devices == ("cuda",)
    assert backend.capabilities.sleep == colocated
    before = greedy(backend)
    held = torch.cuda.memory_allocated()
    backend.finish_generation()
    freed = held - torch.cuda.memory_allocated()
    if colocated:
        assert freed >= 0.9 * model_bytes(tiny_qwen2), f"only {freed} bytes freed"
    else:
        assert freed < 0.5 * model_bytes(tiny_qwen2), f"{freed} bytes freed without colocation"
    backend.prepare_for_generation()
    backend.prepare_for_generation()
    after = greedy(backend)
    assert torch.equal(before["output_ids"], after["output_ids"])
    assert torch.equal(before["logprobs"], after["logprobs"])
    backend.shutdown()


@pytest.mark.parametrize("source", ["cuda", "cpu"])
def test_updates_through_cuda_ipc_and_shared_memory(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], source: str
):
    backend = HfGeneration(make_config(tiny_qwen2, hf_cfg={"device": "cuda"}))
    assert "cuda_ipc" in backend.capabilities.weight_transports
    original = {name: t.to(source) for name, t in tiny_qwen2.state_dict().items()}
    before = greedy(backend)
    with share_weights({name: t * 1.5 for name, t in original.items()}) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    changed = greedy(backend)
    assert not torch.equal(changed["logprobs"], before["logprobs"])
    with share_weights(original) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    after = greedy(backend)
    assert torch.equal(before["output_ids"], after["output_ids"])
    assert torch.equal(before["logprobs"], after["logprobs"])
    backend.shutdown()


def test_update_while_offloaded_lands_on_the_gpu_after_prepare(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    backend = HfGeneration(
        make_config(tiny_qwen2, colocated={"enabled": True}, hf_cfg={"device": "cuda"})
    )
    original = {name: t.cuda() for name, t in tiny_qwen2.state_dict().items()}
    before = greedy(backend)
    backend.finish_generation()
    with share_weights({name: t * 1.5 for name, t in original.items()}) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    # the update woke the weights only: they are on the GPU, and generation still waits
    assert {p.device.type for p in backend._model().model.parameters()} == {"cuda"}
    with pytest.raises(GenerationError, match="after finish_generation"):
        greedy(backend)
    backend.prepare_for_generation()
    assert not torch.equal(greedy(backend)["logprobs"], before["logprobs"])
    backend.shutdown()


def test_batch_invariant_is_refused_on_cuda_before_the_model_loads(make_config, tiny_qwen2):
    from gen_interface import BackendUnavailableError

    config = make_config(tiny_qwen2, batch_invariant=True, hf_cfg={"device": "cuda"})
    with pytest.raises(BackendUnavailableError, match="verified on the CPU only"):
        HfGeneration(config)
