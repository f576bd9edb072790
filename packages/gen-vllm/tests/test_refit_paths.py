"""Every refit path into real vLLM engines gives what a fresh engine loaded from the same weights
on disk gives: a streamed shared-memory refit, the collective path (gloo, the trainer here as
rank 0, every worker a Ray actor), and the first refit of an engine started without reading its
checkpoint (``load_format: dummy``)."""

from __future__ import annotations

import shutil

import pytest
import torch
from gen_interface import WeightsAbsentError
from gen_interface.weights import WeightBroadcaster, refit
from gen_testkit.strategies import pad_prompts

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1], [61, 62]]


@pytest.fixture(scope="module")
def new_weights(tiny_qwen2):
    generator = torch.Generator().manual_seed(11)
    return {
        name: t + 0.3 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in tiny_qwen2.state_dict().items()
    }


@pytest.fixture(scope="module")
def fresh(engines, tiny_qwen2, new_weights, tmp_path_factory):
    """An engine that loaded ``new_weights`` from disk, as any user's engine would."""
    from safetensors.torch import save_file

    where = tmp_path_factory.mktemp("model") / "new"
    shutil.copytree(tiny_qwen2.path, where)
    save_file(new_weights, str(where / "model.safetensors"))
    model = type(tiny_qwen2)(tiny_qwen2.spec, where)
    return engines.get(model, replicas=1)


@pytest.fixture(scope="module")
def backend(engines, tiny_qwen2):
    return engines.get(tiny_qwen2, replicas=2)


def greedy(backend):
    return backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)


def assert_same_as_fresh(out, expected):
    assert torch.equal(out["output_ids"], expected["output_ids"])
    assert float((out["logprobs"] - expected["logprobs"]).abs().max()) <= 1e-6


def test_a_streamed_refit_gives_what_a_fresh_engine_gives(backend, fresh, new_weights, tiny_qwen2):
    before = greedy(backend)
    version = refit(backend, new_weights, bucket_bytes=256 * 1024)  # several buckets
    out = greedy(backend)
    assert_same_as_fresh(out, greedy(fresh))
    assert out["weight_version"].tolist() == [version] * len(PROMPTS)
    refit(backend, tiny_qwen2.state_dict())
    assert torch.equal(greedy(backend)["logprobs"], before["logprobs"])


def test_the_collective_path_gives_what_a_fresh_engine_gives(
    backend, fresh, new_weights, tiny_qwen2
):
    assert "collective" in backend.capabilities.weight_transports
    before = greedy(backend)
    broadcaster = WeightBroadcaster.connect(backend, host="127.0.0.1", timeout_s=120)
    try:
        version = broadcaster.refit(new_weights, bucket_bytes=512 * 1024)
        out = greedy(backend)
        assert_same_as_fresh(out, greedy(fresh))
        assert out["weight_version"].tolist() == [version] * len(PROMPTS)
        broadcaster.refit(tiny_qwen2.state_dict())
    finally:
        broadcaster.close()
    assert torch.equal(greedy(backend)["logprobs"], before["logprobs"])


def test_an_engine_started_without_its_checkpoint_generates_only_after_the_first_refit(
    engines, tiny_qwen2
):
    unloaded = engines.get(tiny_qwen2, replicas=1, vllm_cfg={"load_format": "dummy"})
    with pytest.raises(WeightsAbsentError, match="first weight update"):
        greedy(unloaded)
    with pytest.raises(WeightsAbsentError):  # refused again: nothing ran, nothing changed
        greedy(unloaded)
    version = refit(unloaded, tiny_qwen2.state_dict(), bucket_bytes=256 * 1024)
    out = greedy(unloaded)
    assert_same_as_fresh(out, greedy(engines.get(tiny_qwen2, replicas=1)))
    assert out["weight_version"].tolist() == [version] * len(PROMPTS)
