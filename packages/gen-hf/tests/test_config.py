"""HfConfig validation and loading: bad fields are refused naming the field, before any load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gen_hf import HF_CFG_DEFAULTS, HfConfig, HfGeneration, complete_hf_config
from gen_interface import BackendUnavailableError, GenerationConfigError
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts

BAD_FIELDS: list[tuple[str, Any]] = [
    ("device", "tpu"),
    ("device", "cuda:x"),
    ("device", 3),
    ("attn_implementation", "flash_attention_9"),
    ("max_batch_size", 0),
    ("max_batch_size", 2.5),
    ("max_batch_size", True),
    ("max_model_len", 1),
    ("max_model_len", "long"),
    ("load_tokenizer", "yes"),
    ("trust_remote_code", "no"),
    ("model_kwargs", []),
    ("model_kwargs", {"dtype": "float64"}),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_bad_hf_cfg_field_is_refused_naming_it(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], field: str, value: Any
):
    config = make_config(tiny_qwen2, hf_cfg={field: value})
    with pytest.raises(GenerationConfigError, match=f"hf_cfg\\.{field}"):
        HfGeneration(config)


def test_unknown_hf_cfg_key_and_non_dict_are_refused(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    with pytest.raises(GenerationConfigError, match="max_batchsize"):
        HfGeneration(make_config(tiny_qwen2, hf_cfg={"max_batchsize": 4}))
    with pytest.raises(GenerationConfigError, match="`hf_cfg` must be a dict"):
        HfGeneration(make_config(tiny_qwen2, hf_cfg=3))


def test_bad_generation_field_is_refused(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    with pytest.raises(GenerationConfigError, match="top_p"):
        HfGeneration(make_config(tiny_qwen2, top_p=0.0))


def test_complete_hf_config_fills_defaults_and_leaves_its_argument_alone(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    config = make_config(tiny_qwen2, hf_cfg={"max_batch_size": 3})
    completed = complete_hf_config(config)
    assert completed["hf_cfg"] == {**HF_CFG_DEFAULTS, "max_batch_size": 3}
    assert config["hf_cfg"] == {"max_batch_size": 3}


def test_a_model_that_does_not_load_names_model_name(
    tmp_path: Any, tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(GenerationConfigError, match="model_name"):
        HfGeneration(make_config(tiny_qwen2, model_name=str(tmp_path)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_cuda_asked_for_without_a_cuda_device_is_unavailable(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        HfGeneration(make_config(tiny_qwen2, hf_cfg={"device": "cuda"}))


def test_dtype_auto_is_the_checkpoints_and_a_named_dtype_is_used(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    auto = HfGeneration(make_config(tiny_qwen2, dtype="auto"))
    assert {t.dtype for t in auto.state_dict().values()} == {torch.float32}
    auto.shutdown()
    half = HfGeneration(make_config(tiny_qwen2, dtype="bfloat16"))
    assert {t.dtype for t in half.state_dict().values()} == {torch.bfloat16}
    output = half.generate(pad_prompts([[5, 6, 7]], "left"), greedy=True)
    assert output["logprobs"].dtype == torch.float32
    assert bool(torch.isfinite(output["logprobs"]).all())
    half.shutdown()
