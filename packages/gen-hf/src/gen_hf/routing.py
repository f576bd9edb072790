"""Reading a mixture-of-experts model's routing (``return_routed_experts``) as it runs.

transformers' MoE models (Qwen2/3-MoE, Mixtral, OLMoE, ...) route through one ``*TopKRouter``
module per MoE layer, whose forward returns ``(router_logits, weights, expert_ids)`` for the
flattened tokens of the pass, the ids most heavily weighted first. A forward hook on each keeps
what it chose; ``RouterCapture.take`` hands the pass's choices over, every layer together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["RouterCapture", "routing_capture"]


class RouterCapture:
    """Forward hooks on every MoE router of ``model``, in layer order, until ``remove``.

    Attributes:
        shape: ``(MoE layers, top_k)``.

    Raises:
        ValueError: the model has no router this recognises (not an MoE model), or its MoE
            layers route to different numbers of experts.
    """

    def __init__(self, model: torch.nn.Module):
        routers = [m for m in model.modules() if _is_router(m)]
        if not routers:
            raise ValueError(
                f"{type(model).__name__} has no MoE router (no module with a top_k whose class "
                "name ends in 'Router')"
            )
        top_ks: set[int] = {router.top_k for router in routers}  # type: ignore[misc]
        if len(top_ks) != 1:
            raise ValueError(f"the MoE layers route to different numbers of experts: {top_ks}")
        self.shape = (len(routers), top_ks.pop())
        self._taken: list[list[torch.Tensor]] = [[] for _ in routers]
        self._hooks = [
            router.register_forward_hook(self._keeper(layer))
            for layer, router in enumerate(routers)
        ]

    def _keeper(self, layer: int) -> Any:
        def keep(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            self._taken[layer].append(output[-1].detach())

        return keep

    def take(self, batch: int) -> torch.Tensor:
        """The routing of the forward passes since the last call, which read ``batch`` rows of
        equal length: int64 ``[batch, tokens per row, layers, top_k]`` on the CPU.

        Raises:
            RuntimeError: some layer ran a different number of times than another, or its
                tokens do not split into ``batch`` rows.
        """
        taken, self._taken = self._taken, [[] for _ in self._taken]
        if not all(taken):
            raise RuntimeError("some MoE layers did not run in the forward pass")
        per_layer = [torch.cat(chosen) for chosen in taken]  # each [tokens, k]
        if len({ids.shape for ids in per_layer}) != 1:
            raise RuntimeError("the MoE layers did not all run on the same tokens")
        stacked = torch.stack(per_layer, dim=1).cpu()  # [tokens, layers, k]
        return stacked.reshape(batch, -1, *self.shape)

    def clear(self) -> None:
        """Forget what was captured (a pass that failed midway)."""
        self._taken = [[] for _ in self._taken]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def routing_capture(model: torch.nn.Module, config: Mapping[str, Any]) -> RouterCapture | None:
    """A capture on ``model`` when ``config`` asks for ``return_routed_experts`` and the model
    has MoE routers; None otherwise (the base then refuses the setting, naming the model)."""
    if not config.get("return_routed_experts") or not any(map(_is_router, model.modules())):
        return None
    return RouterCapture(model)


def _is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Router") and isinstance(
        getattr(module, "top_k", None), int
    )
