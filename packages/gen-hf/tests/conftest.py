"""Fixtures shared by gen-hf's tests: configs and reference transformers models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from gen_hf import HF_CFG_DEFAULTS, HfConfig
from gen_testkit.models import TinyModel
from transformers import AutoModelForCausalLM, PreTrainedModel


def hf_config(model: TinyModel, **overrides: Any) -> HfConfig:
    """A complete float32 config for ``model`` on the CPU; ``overrides`` replace keys."""
    config: dict[str, Any] = {
        "backend": "hf",
        "model_name": str(model.path),
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": [model.eos_token_id],
        "stop_strings": None,
        "pad_token_id": model.pad_token_id,
        "logprobs_mode": "raw",
        "seed": 7,
        "dtype": "float32",
        "colocated": {"enabled": False},
        "hf_cfg": {"device": "cpu"},
    }
    config.update(overrides)
    return cast(HfConfig, config)


@pytest.fixture(scope="session")
def make_config() -> Callable[..., HfConfig]:
    """``make_config(model, **overrides)``: see ``hf_config``."""
    return hf_config


@pytest.fixture(scope="session")
def reference_model() -> Callable[[TinyModel], PreTrainedModel]:
    """``reference_model(model)``: transformers' own float32 model, loaded once per model, with
    the attention kernel HfGeneration uses by default."""
    loaded: dict[str, PreTrainedModel] = {}

    def load(model: TinyModel) -> PreTrainedModel:
        key = str(model.path)
        if key not in loaded:
            loaded[key] = AutoModelForCausalLM.from_pretrained(
                key,
                dtype=torch.float32,
                attn_implementation=HF_CFG_DEFAULTS["attn_implementation"],
            ).eval()
        return loaded[key]

    return load


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Run the tiny models on one CPU thread: at hidden size 128 more threads do not help, and
    on a busy machine their synchronisation makes every forward pass many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
