"""Adapter-only LoRA refit on gen-hf: after an adapter refit, outputs are those of the base model
with the adapter merged in; a refit dropped midway leaves the previous adapter serving; a base
refit and adapter refits mix in one run, each a verified transaction with its version."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_interface import GenerationConfigError, WeightUpdateError
from gen_interface.weights import Refitter
from gen_testkit.adapters import merge_adapter, random_adapter
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7, 7, 7, 7], [300, 12, 40, 41, 43]]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
#: float32 logprobs of the adapter (a hook adding B(Ax)) against the merged weight W + sBA: the
#: same sum rounded in another order; measured up to 1.24e-5 on these rows. The project's float32
#: logprob bound.
ATOL = 2e-5


@pytest.fixture(scope="module")
def backends(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
) -> Iterator[tuple[HfGeneration, HfGeneration]]:
    """(with an adapter, plain): the plain one takes merged weights to compare with."""
    adapted = HfGeneration(make_config(tiny_qwen2, lora=LORA))
    plain = HfGeneration(make_config(tiny_qwen2))
    yield adapted, plain
    adapted.shutdown()
    plain.shutdown()


def _same_outputs(first: HfGeneration, second: HfGeneration) -> None:
    batch = pad_prompts(PROMPTS, "left")
    for greedy in (True, False):
        mine, theirs = first.generate(batch, greedy=greedy), second.generate(batch, greedy=greedy)
        assert torch.equal(mine["output_ids"], theirs["output_ids"])
        torch.testing.assert_close(mine["logprobs"], theirs["logprobs"], atol=ATOL, rtol=0)


def test_a_new_adapter_starts_at_zero_and_serves_the_base_model(backends, tiny_qwen2):
    adapted, plain = backends
    plain.update_weights_from_state_dict(tiny_qwen2.state_dict())
    _same_outputs(adapted, plain)


def test_after_an_adapter_refit_outputs_are_the_merged_models(backends, tiny_qwen2):
    adapted, plain = backends
    before = adapted.weight_version
    for seed in (1, 2):  # twice: the second replaces the first
        lora = random_adapter(tiny_qwen2.state_dict(), LORA, seed=seed)
        with Refitter(adapted) as refitter:
            refitter.refit(lora)
        plain.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), lora, LORA))
        _same_outputs(adapted, plain)
    assert adapted.weight_version == before + 2
    out = adapted.generate(pad_prompts(PROMPTS[:1], "right"), greedy=True)
    assert int(out["weight_version"][0]) == adapted.weight_version


def test_a_refit_dropped_midway_leaves_the_previous_adapter_serving(backends, tiny_qwen2):
    adapted, plain = backends
    served = random_adapter(tiny_qwen2.state_dict(), LORA, seed=3)
    adapted.update_weights_from_state_dict(served)
    plain.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), served, LORA))
    version = adapted.weight_version
    unfinished = random_adapter(tiny_qwen2.state_dict(), LORA, seed=4, scale=1.0)
    half = dict(list(unfinished.items())[:4])
    adapted.start_weight_update()
    adapted.update_weights_from_state_dict(half)  # written to the staged copy
    with pytest.raises(WeightUpdateError, match=r"missing .*lora"):
        adapted.commit_weight_update()  # incomplete: dropped
    assert adapted.weight_version == version and adapted.state == "ready"
    _same_outputs(adapted, plain)


def test_an_update_carries_the_base_the_adapter_or_both_each_whole(backends, tiny_qwen2):
    adapted, plain = backends
    base, lora = tiny_qwen2.state_dict(), random_adapter(tiny_qwen2.state_dict(), LORA, seed=5)
    partial = dict(list(lora.items())[:-1])
    with pytest.raises(WeightUpdateError, match="its base, its adapter, or both"):
        adapted.update_weights_from_state_dict(partial)
    with pytest.raises(WeightUpdateError, match="missing"):
        adapted.update_weights_from_state_dict({**lora, "lm_head.weight": base["lm_head.weight"]})
    # the base alone (a full refit, the adapter kept), then both at once
    shifted = {name: t * 0.9 if t.dim() == 2 else t for name, t in base.items()}
    adapted.update_weights_from_state_dict({**shifted, **lora})
    plain.update_weights_from_state_dict(merge_adapter(shifted, lora, LORA))
    _same_outputs(adapted, plain)
    adapted.update_weights_from_state_dict(base)
    plain.update_weights_from_state_dict(merge_adapter(base, lora, LORA))
    _same_outputs(adapted, plain)


def test_a_peft_adapter_directory_is_read(
    tmp_path: Path, tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], backends
):
    from safetensors.torch import save_file

    _, plain = backends
    lora = random_adapter(tiny_qwen2.state_dict(), LORA, seed=6)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    )
    save_file(lora, str(tmp_path / "adapter_model.safetensors"))
    from_file = HfGeneration(make_config(tiny_qwen2, lora={"adapter_path": str(tmp_path)}))
    try:
        plain.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), lora, LORA))
        _same_outputs(from_file, plain)
    finally:
        from_file.shutdown()


@pytest.mark.parametrize(
    ("lora", "extra", "message"),
    [
        ({**LORA, "target_modules": ["nope"]}, {}, "match no linear layer"),
        ({**LORA, "rank": 0}, {}, "lora.rank must be an integer >= 1"),
        ({"adapter_path": "/nonexistent"}, {}, "not a PEFT adapter directory"),
        (LORA, {"batch_invariant": True}, "batch_invariant and lora"),
    ],
)
def test_a_lora_section_that_cannot_work_is_refused(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], lora, extra, message
):
    with pytest.raises(GenerationConfigError, match=message):
        HfGeneration(make_config(tiny_qwen2, lora=lora, **extra))
