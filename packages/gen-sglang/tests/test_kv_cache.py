"""The KV cache is sized by bytes (``sglang_cfg.kv_cache_gib``), not by a fraction of the memory
that happens to be free while a server starts."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gen_interface import GenerationConfigError, configure_generation_config
from gen_sglang import SglangGeneration
from gen_sglang.config import SGLANG_CFG_DEFAULTS, SglangSettings, complete_sglang_config
from gen_sglang.kv_cache import CPU_KV_CACHE_GIB, kv_bytes_per_token, kv_cache_args
from gen_testkit.models import TinyModel

GIB = 1 << 30
BASE: dict[str, Any] = {"backend": "sglang", "model_name": "m", "pad_token_id": 0}


def _settings(**changes: Any) -> SglangSettings:
    return {**SGLANG_CFG_DEFAULTS, **changes}  # type: ignore[typeddict-item]


def _per_token(model: TinyModel, dtype_bytes: int) -> int:
    """Keys and values of every layer, from the model's own sizes."""
    spec = model.spec
    head_dim = spec.hidden_size // spec.num_attention_heads
    return 2 * spec.num_hidden_layers * spec.num_key_value_heads * head_dim * dtype_bytes


def test_a_token_takes_the_bytes_of_its_keys_and_values_in_the_served_dtype(
    tiny_qwen2: TinyModel,
):
    assert kv_bytes_per_token(tiny_qwen2.path, "float32") == _per_token(tiny_qwen2, 4)
    assert kv_bytes_per_token(tiny_qwen2.path, "bfloat16") == _per_token(tiny_qwen2, 2)


def test_on_the_cpu_sglang_is_given_the_tokens_of_the_budget_and_measures_no_fraction():
    """``--mem-fraction-static 1``: SGLang's pool is free memory after loading minus
    ``(1 - fraction)`` of free memory before; with 1 nothing is subtracted, so memory other
    processes take during the start no longer fails it, and ``--max-total-tokens`` fixes the
    pool at the budget's tokens."""
    per_token = 1024
    args = kv_cache_args(_settings(kv_cache_gib=0.5), per_token, cpu=True)
    assert args == ["--mem-fraction-static", "1", "--max-total-tokens", str(GIB // 2 // 1024)]
    default = kv_cache_args(_settings(), per_token, cpu=True)
    assert default[-1] == str(int(CPU_KV_CACHE_GIB * GIB) // per_token)
    assert default[:2] == ["--mem-fraction-static", "1"]
    capped = kv_cache_args(_settings(kv_cache_gib=0.5, max_total_tokens=4096), per_token, cpu=True)
    assert capped[-1] == "4096", "max_total_tokens caps the budget's tokens"
    chosen = kv_cache_args(_settings(mem_fraction_static=0.3), per_token, cpu=True)
    assert chosen[:2] == ["--mem-fraction-static", "0.3"], "a fraction that is set is kept"


def test_on_a_gpu_sglang_sizes_the_cache_itself_unless_a_budget_is_set():
    assert kv_cache_args(_settings(), 1024, cpu=False) == []
    assert kv_cache_args(_settings(kv_cache_gib=1.0), 1024, cpu=False) == [
        "--max-total-tokens",
        str(GIB // 1024),
    ]


@pytest.mark.parametrize("value", [0, -1.0, "1", True])
def test_a_budget_that_is_not_a_positive_number_is_refused_by_its_path(value: Any):
    cfg = {"kv_cache_gib": value}
    with pytest.raises(GenerationConfigError, match=r"sglang_cfg\.kv_cache_gib"):
        complete_sglang_config(configure_generation_config(dict(BASE, sglang_cfg=cfg), None))


def test_a_budget_too_small_for_two_tokens_is_refused_before_a_server_starts(
    tiny_qwen2: TinyModel,
):
    with pytest.raises(GenerationConfigError, match=r"sglang_cfg\.kv_cache_gib=1e-09 holds 0"):
        SglangGeneration(
            {
                "backend": "sglang",
                "model_name": str(tiny_qwen2.path),
                "sglang_cfg": {"kv_cache_gib": 1e-9},
            }
        )


def _find(tree: Any, key: str) -> list[Any]:
    """Every value of ``key`` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        own = [tree[key]] if key in tree else []
        return own + [v for x in tree.values() for v in _find(x, key)]
    if isinstance(tree, list):
        return [v for x in tree for v in _find(x, key)]
    return []


def test_a_server_holds_exactly_the_tokens_of_its_byte_budget(tiny_qwen2: TinyModel):
    """A real server: its scheduler reports the pool it made, which is the budget's tokens, not
    what a fraction of the machine's free memory would give."""
    gib = 0.01
    backend = SglangGeneration(
        {
            "backend": "sglang",
            "model_name": str(tiny_qwen2.path),
            "dtype": "float32",
            "sglang_cfg": {"kv_cache_gib": gib},
        }
    )
    try:
        url = backend._servers[0].url
        info = httpx.get(f"{url}/server_info", timeout=30.0).json()
    finally:
        backend.shutdown()
    expected = int(gib * GIB) // _per_token(tiny_qwen2, 4)
    assert set(_find(info, "max_total_num_tokens")) == {expected}, info
