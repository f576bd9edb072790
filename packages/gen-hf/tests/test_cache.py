"""The preallocated KV cache holds exactly what transformers' growing cache would."""

from __future__ import annotations

from collections.abc import Callable

import gen_hf.decode
import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_hf.cache import PreallocatedLayer, drop_leading_columns, new_group_cache
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from transformers import DynamicCache, Qwen2Config
from transformers.cache_utils import DynamicLayer


def states(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 2, length, 8, generator=generator),
        torch.randn(rows, 2, length, 8, generator=generator),
    )


def test_preallocated_layer_matches_a_growing_layer():
    ours, theirs = PreallocatedLayer(capacity=9), DynamicLayer()
    for step, length in enumerate((5, 1, 1)):
        keys, values = states(4, length, step)
        got, want = ours.update(keys, values), theirs.update(keys, values)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.get_seq_length() == theirs.get_seq_length() == 7
    index = torch.tensor([0, 2])
    ours.batch_select_indices(index)
    theirs.batch_select_indices(index)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    ours.drop_leading(3)
    assert torch.equal(ours.keys, theirs.keys[:, :, 3:]) and ours.get_seq_length() == 4
    keys, values = states(2, 1, 9)
    got = ours.update(keys, values)
    assert torch.equal(got[0], torch.cat([theirs.keys[:, :, 3:], keys], dim=2))
    with pytest.raises(RuntimeError, match="overflow"):
        ours.update(*states(2, 2, 10))


def test_full_attention_models_get_preallocated_layers_others_keep_theirs():
    common = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}
    full = new_group_cache(Qwen2Config(**common), capacity=16)
    assert all(isinstance(layer, PreallocatedLayer) for layer in full.layers)
    sliding = new_group_cache(
        Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=0),
        capacity=16,
    )
    assert not any(isinstance(layer, PreallocatedLayer) for layer in sliding.layers)
    assert not drop_leading_columns(sliding, 1)


def test_generation_is_the_same_with_transformers_own_cache(
    tiny_llama: TinyModel,
    make_config: Callable[..., HfConfig],
    monkeypatch: pytest.MonkeyPatch,
):
    """Rows finish at different steps, so rows and leading columns are dropped on the way."""
    backend = HfGeneration(make_config(tiny_llama, stop_token_ids=list(range(3, 512, 17))))
    batch = pad_prompts([[5, 17, 42, 8], [99], [7] * 9, [300, 12], [41, 42, 43]], "left")
    preallocated = [backend.generate(batch, greedy=g) for g in (True, False)]
    monkeypatch.setattr(
        gen_hf.decode,
        "new_group_cache",
        lambda config, capacity: DynamicCache(config=config),
    )
    growing = [backend.generate(batch, greedy=g) for g in (True, False)]
    backend.shutdown()
    assert len(set(preallocated[0]["generation_lengths"].tolist())) > 1
    for a, b in zip(preallocated, growing):
        assert torch.equal(a["output_ids"], b["output_ids"])
        # The caches hold the same keys and values, but attention sums them in other orders as
        # rows and leading columns are dropped: measured 0 greedy, 2.6e-6 on a sampled row.
        assert torch.allclose(a["logprobs"], b["logprobs"], rtol=0, atol=4e-6)
