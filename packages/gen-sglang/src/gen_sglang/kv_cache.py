"""The KV cache of an SGLang server, sized by bytes.

SGLang sizes its KV cache from memory it measures as it starts: the pool gets what is free after
the weights load minus ``(1 - --mem-fraction-static)`` of what was free before. On the CPU
"free" is the machine's available memory, so a start fails ("Loaded weights leave no GPU memory
for the KV cache") when other processes take memory while it loads, and the pool's size depends
on the neighbours. SGLang has no option for a byte budget; ``--max-total-tokens`` caps the pool
at a token count. So a byte budget (``sglang_cfg.kv_cache_gib``, as vLLM's CPU backend is given
``VLLM_CPU_KVCACHE_SPACE``) is turned into the tokens it holds for the served model, and on the
CPU SGLang is told to measure against all of free memory (``--mem-fraction-static 1``): the pool
is then exactly those tokens whenever the machine has that much memory free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gen_interface import GenerationConfigError

from gen_sglang.config import SglangSettings

__all__ = ["CPU_KV_CACHE_GIB", "kv_bytes_per_token", "kv_cache_args"]

#: ``sglang_cfg.kv_cache_gib`` on the CPU when it is left out.
CPU_KV_CACHE_GIB = 0.25

_GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes one token takes in the KV cache of one server serving ``model_dir`` in ``dtype``.

    Full attention: keys and values, ``2 * layers * kv_heads * head_dim`` values; MLA models
    (``kv_lora_rank`` in the config): one latent of ``kv_lora_rank + qk_rope_head_dim`` per
    layer. The cache holds the served dtype (a ``--kv-cache-dtype`` in ``extra_args`` is not
    counted).

    Raises:
        GenerationConfigError: ``config.json`` is unreadable or lacks the attention's sizes.
    """
    try:
        config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
        text = config.get("text_config", config)
        layers = int(text["num_hidden_layers"])
        if text.get("kv_lora_rank"):
            values = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0))
        else:
            heads = int(text["num_attention_heads"])
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
            values = 2 * kv_heads * head_dim
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GenerationConfigError(
            f"cannot size SGLang's KV cache: {model_dir / 'config.json'} does not give the "
            f"attention's sizes ({exc!r}); set sglang_cfg.max_total_tokens and "
            "sglang_cfg.mem_fraction_static instead"
        ) from exc
    return layers * values * _DTYPE_BYTES.get(dtype, 4)


def kv_cache_args(settings: SglangSettings, bytes_per_token: int, *, cpu: bool) -> list[str]:
    """``--max-total-tokens`` and ``--mem-fraction-static`` for a server.

    The tokens are what ``kv_cache_gib`` holds (``CPU_KV_CACHE_GIB`` on the CPU when null),
    capped by ``max_total_tokens``; ``mem_fraction_static`` is passed when set, else 1 on the
    CPU whenever the pool is capped. On a GPU with neither ``kv_cache_gib`` nor
    ``max_total_tokens`` set, SGLang sizes the pool itself.

    Raises:
        GenerationConfigError: ``kv_cache_gib`` holds fewer than 2 tokens of this model.
    """
    gib = settings["kv_cache_gib"]
    if gib is None and cpu:
        gib = CPU_KV_CACHE_GIB
    tokens = settings["max_total_tokens"]
    if gib is not None:
        fits = int(gib * _GIB) // bytes_per_token
        if fits < 2:
            raise GenerationConfigError(
                f"sglang_cfg.kv_cache_gib={gib:g} holds {fits} tokens of this model "
                f"({bytes_per_token} bytes each); raise it"
            )
        tokens = fits if tokens is None else min(tokens, fits)
    fraction = settings["mem_fraction_static"]
    if fraction is None and cpu and tokens is not None:
        fraction = 1.0
    args: list[str] = []
    if fraction is not None:
        args += ["--mem-fraction-static", f"{fraction:g}"]
    if tokens is not None:
        args += ["--max-total-tokens", str(tokens)]
    return args
