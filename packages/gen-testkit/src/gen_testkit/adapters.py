"""LoRA adapters for tests: random ones of a model's shape, and the model with one merged in.

An adapter-only refit is right when the backend then answers as the base model with the
adapter merged into its weights (``W + (alpha / rank) B A`` in every target) does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gen_backend_kit.lora import PEFT_PREFIX, adapter_specs

__all__ = ["merge_adapter", "random_adapter"]


def random_adapter(
    state_dict: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    *,
    seed: int,
    scale: float = 0.05,
) -> dict[str, torch.Tensor]:
    """A random adapter (PEFT's names) for the model of ``state_dict``: entries ``scale`` times
    a standard normal, drawn from ``seed``."""
    shapes = {name: (t.shape, t.dtype) for name, t in state_dict.items()}
    generator = torch.Generator().manual_seed(seed)
    return {
        name: scale * torch.randn(shape, generator=generator).to(dtype)
        for name, (shape, dtype) in sorted(adapter_specs(shapes, settings).items())
    }


def merge_adapter(
    state_dict: Mapping[str, torch.Tensor],
    adapter: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """``state_dict`` with the adapter merged into every target weight."""
    scaling = float(settings["alpha"]) / int(settings["rank"])
    out = dict(state_dict)
    for name in adapter:
        if ".lora_A." not in name:
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        a, b = adapter[name], adapter[name.replace(".lora_A.", ".lora_B.")]
        out[f"{module}.weight"] = state_dict[f"{module}.weight"] + scaling * b @ a
    return out
