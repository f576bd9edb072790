"""A LoRA adapter on a loaded model, refitted alone (the config's ``lora`` section).

Each target ``nn.Linear`` (``W``: ``[out, in]``) computes ``W x + s * B (A x)`` with ``A``:
``[r, in]``, ``B``: ``[out, r]`` and ``s = alpha / r``, added by a forward hook: the base
weights, their names and the model's own forward stay as they are. The adapter's tensors carry
PEFT's names (``base_model.model.<module>.lora_A.weight``, ``...lora_B.weight``), so a trainer
sends ``peft.get_peft_model_state_dict(model)`` as it is.

An adapter update is staged: loads write a second copy, which ``commit`` puts in place between
two decode steps and ``discard`` forgets. A refit dropped midway therefore leaves the previous
adapter serving, whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from gen_backend_kit.lora import PEFT_PREFIX, lora_settings

__all__ = ["LoraAdapter"]


class LoraAdapter:
    """The adapter of ``model``: live tensors its hooks read, and the staged copy loads write.

    Args:
        model: the loaded model (its device and dtype are the adapter's).
        section: the config's ``lora`` section.

    Raises:
        ValueError: no ``nn.Linear`` of the model matches ``target_modules``, or the adapter
            file does not fit the model.
    """

    def __init__(self, model: torch.nn.Module, section: Mapping[str, Any]):
        settings = lora_settings(section)
        rank, targets = int(settings["rank"]), [str(t) for t in settings["target_modules"]]
        self.scaling = float(settings["alpha"]) / rank
        modules = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
        }
        if not modules:
            raise ValueError(
                f"lora.target_modules {targets} match no linear layer of {type(model).__name__}"
            )
        self.live: dict[str, torch.Tensor] = {}
        for name, module in modules.items():
            weight = module.weight
            for part, shape in (
                ("A", (rank, module.in_features)),
                ("B", (module.out_features, rank)),
            ):
                self.live[f"{PEFT_PREFIX}{name}.lora_{part}.weight"] = torch.zeros(
                    shape, dtype=weight.dtype, device=weight.device
                )
        self.staged = {name: tensor.clone() for name, tensor in self.live.items()}
        if section.get("adapter_path"):
            self._read(Path(section["adapter_path"]))
        self._hooks = [
            module.register_forward_hook(self._adding(f"{PEFT_PREFIX}{name}"))
            for name, module in modules.items()
        ]

    def _adding(self, prefix: str) -> Any:
        a, b = self.live[f"{prefix}.lora_A.weight"], self.live[f"{prefix}.lora_B.weight"]

        def add(_module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            low_rank = torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b)
            return output + self.scaling * low_rank

        return add

    def _read(self, path: Path) -> None:
        from safetensors.torch import load_file

        tensors = load_file(str(path / "adapter_model.safetensors"))
        named = {name.replace(".lora_A.default.", ".lora_A."): t for name, t in tensors.items()}
        named = {name.replace(".lora_B.default.", ".lora_B."): t for name, t in named.items()}
        if set(named) != set(self.live):
            missing = sorted(set(self.live) - set(named))[:3]
            extra = sorted(set(named) - set(self.live))[:3]
            raise ValueError(
                f"the adapter at {path} does not fit the model: missing {missing}, unknown {extra}"
            )
        with torch.no_grad():
            for name, tensor in named.items():
                self.live[name].copy_(tensor)
                self.staged[name].copy_(tensor)

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{name: (shape, dtype)}`` of every adapter tensor: what an adapter update carries."""
        return {name: (t.shape, t.dtype) for name, t in self.live.items()}

    def commit(self) -> None:
        """Serve the staged adapter (the caller holds the gate: no step runs)."""
        with torch.no_grad():
            for name, tensor in self.staged.items():
                self.live[name].copy_(tensor)

    def discard(self) -> None:
        """Forget staged writes: the live adapter stays."""
        with torch.no_grad():
            for name, tensor in self.live.items():
                self.staged[name].copy_(tensor)

    def to(self, device: torch.device | str) -> None:
        """Move the adapter with its model (``move_model``), keeping the tensors the hooks
        hold."""
        for tensor in (*self.live.values(), *self.staged.values()):
            tensor.data = tensor.data.to(device)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
