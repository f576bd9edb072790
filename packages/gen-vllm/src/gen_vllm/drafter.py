"""The drafter model's weights as a refit group of their own (``speculative.method``
``"draft_model"``).

An update names the drafter's tensors ``"drafter." + <the drafter checkpoint's name>``. The
transfer engine keeps them aside, verified, and never loads them into the target
(``transfer.py``); the commit loads them into the drafter model (``load_drafter_weights``), so an
update that is dropped leaves the drafter as it was.

This module imports vLLM only inside its functions, so test fakes can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

__all__ = ["DRAFTER_PREFIX", "draft_model_config", "is_drafter_weight", "load_drafter_weights"]

#: The prefix of the drafter's weight names in an update.
DRAFTER_PREFIX = "drafter."


def is_drafter_weight(name: str) -> bool:
    """Whether ``name`` is one of the drafter model's tensors in an update."""
    return name.startswith(DRAFTER_PREFIX)


def draft_model_config(vllm_config: Any) -> Any | None:
    """The drafter model's ``ModelConfig`` when the engine drafts with a model of its own
    (``speculative_config.method == "draft_model"``); None otherwise."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None or getattr(speculative, "method", None) != "draft_model":
        return None
    return speculative.draft_model_config


def load_drafter_weights(
    model: torch.nn.Module, model_config: Any, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Load ``tensors`` (update names, ``"drafter."`` prefixed) into the drafter ``model`` in
    one layerwise reload, ended with the drafter's own ``model_config`` (vLLM's CPU linear
    layers repack their weights when it ends)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    cast(Any, model).load_weights(
        (name.removeprefix(DRAFTER_PREFIX), tensor) for name, tensor in tensors.items()
    )
    finalize_layerwise_reload(model, model_config)
