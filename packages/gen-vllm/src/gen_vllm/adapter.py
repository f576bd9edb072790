"""The LoRA adapter a gen-vllm engine serves (the config's ``lora`` section).

vLLM serves adapters from PEFT directories, named in each request's ``LoRARequest``. Every
request here names one adapter, id ``ADAPTER_ID``; an adapter refit arrives through the weight
transaction like any weights (``transfer.py`` keeps its tensors aside), the worker writes it as a
new PEFT directory at the commit, and ``LoRARequest(..., load_inplace=True)`` replaces the
served adapter in place, between two steps, for running rows too. Each version gets its own
directory: vLLM's prefix cache is keyed by an adapter's name and path, so no KV computed under
an old adapter is reused (and the cache is reset at every commit anyway).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["ADAPTER_ID", "ADAPTER_NAME", "lora_engine_args", "write_peft_adapter"]

ADAPTER_NAME = "gen-adapter"
ADAPTER_ID = 1
#: The ranks vLLM's ``max_lora_rank`` takes (``vllm.config.lora.MaxLoRARanks``).
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_args(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.EngineArgs`` for serving one adapter of ``settings["rank"]``."""
    rank = int(settings["rank"])
    fitting = [r for r in _VLLM_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"lora.rank {rank} is above vLLM's largest, {_VLLM_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1}


def write_peft_adapter(
    directory: str | Path, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
) -> None:
    """Write ``tensors`` (PEFT's names) as a PEFT adapter directory vLLM loads."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": int(settings["rank"]),
        "lora_alpha": float(settings["alpha"]),
        "target_modules": list(settings["target_modules"]),
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
