"""A ``lora`` config section read the same way by every backend: rank, alpha, targets, names.

An adapter's tensors carry PEFT's names, ``base_model.model.<module>.lora_A.weight`` (``[r,
in]``) and ``...lora_B.weight`` (``[out, r]``), for every linear layer whose last name is in
``target_modules``; a trainer sends ``peft.get_peft_model_state_dict(model)`` as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["PEFT_PREFIX", "adapter_specs", "is_adapter_weight", "lora_settings"]

#: The prefix PEFT puts before a module's name in an adapter's state dict.
PEFT_PREFIX = "base_model.model."


def lora_settings(section: Mapping[str, Any]) -> dict[str, Any]:
    """``rank``, ``alpha`` and ``target_modules`` of a ``lora`` section; from its
    ``adapter_path``'s ``adapter_config.json`` (PEFT's ``r``, ``lora_alpha``,
    ``target_modules``) when it names one."""
    path = section.get("adapter_path")
    if not path:
        return {key: section[key] for key in ("rank", "alpha", "target_modules")}
    peft = json.loads((Path(path) / "adapter_config.json").read_text())
    return {
        "rank": int(peft["r"]),
        "alpha": float(peft["lora_alpha"]),
        "target_modules": list(peft["target_modules"]),
    }


def is_adapter_weight(name: str) -> bool:
    return name.startswith(PEFT_PREFIX) and (".lora_A." in name or ".lora_B." in name)


def adapter_specs(
    checkpoint: Mapping[str, tuple[torch.Size, torch.dtype]], settings: Mapping[str, Any]
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{name: (shape, dtype)}`` of the adapter of a model whose checkpoint holds
    ``checkpoint``: one ``lora_A`` and one ``lora_B`` per 2-D ``<module>.weight`` whose module's
    last name is a target.

    Raises:
        ValueError: no weight of the checkpoint matches ``target_modules``.
    """
    rank, targets = int(settings["rank"]), set(settings["target_modules"])
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for name, (shape, dtype) in checkpoint.items():
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (torch.Size([rank, shape[1]]), dtype)
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (torch.Size([shape[0], rank]), dtype)
    if not out:
        raise ValueError(f"lora.target_modules {sorted(targets)} match no linear layer")
    return out
