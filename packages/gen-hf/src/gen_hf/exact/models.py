"""Batch-invariant forward passes for transformers models: the same kernels on both sides.

``batch_invariant(model)`` makes every ``nn.Linear`` of a transformers causal LM use
``invariant_linear`` and its attention ``invariant_attention`` (registered through transformers'
attention and mask interfaces under ``ATTENTION_NAME``), for as long as the ``with`` block
lasts, or for good with ``make_batch_invariant``. A trainer wraps its own model in it to compute
the logprobs that a backend in batch-invariant mode returns, bit for bit; gen-hf wraps the model
it generates with (``use_batch_invariant_kernels``: checked on this machine first).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from gen_interface import BackendUnavailableError
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from gen_hf.exact.check import batch_invariance_problems
from gen_hf.exact.kernels import invariant_attention, invariant_linear

__all__ = [
    "ATTENTION_NAME",
    "batch_invariant",
    "make_batch_invariant",
    "restore_model",
    "use_batch_invariant_kernels",
]

#: The name under which the attention function and its mask are registered with transformers.
ATTENTION_NAME = "gen_batch_invariant"

_SAVED = "_gen_batch_invariant_saved_attn"


@contextmanager
def batch_invariant(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model`` with batch-invariant kernels inside the block; restore it after.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through transformers'
            attention interface (every model with ``_supports_attention_backend``).

    Yields:
        ``model`` itself.

    Raises:
        ValueError: the model is not a transformers model, has sliding-window layers, or
            cannot take a registered attention function.
    """
    was_invariant = hasattr(model, _SAVED)
    make_batch_invariant(model)
    try:
        yield model
    finally:
        if not was_invariant:
            restore_model(model)


def make_batch_invariant(model: torch.nn.Module) -> None:
    """Switch ``model`` to the batch-invariant kernels until ``restore_model``.

    Raises:
        ValueError: the model is not a transformers model, has sliding-window layers, or
            cannot take a registered attention function.
    """
    if hasattr(model, _SAVED):
        return
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers PreTrainedModel: batch-invariant "
            "mode needs transformers' attention interface"
        )
    windowed = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if windowed:
        raise ValueError(
            f"{type(model).__name__} has {windowed} layers: batch-invariant attention supports "
            "full attention only"
        )
    saved = config._attn_implementation
    try:
        model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
    except (ValueError, NotImplementedError) as exc:
        raise ValueError(
            f"{type(model).__name__} cannot use a registered attention function, so it cannot "
            f"run batch-invariant: {exc}"
        ) from exc
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)  # type: ignore[method-assign]
    setattr(model, _SAVED, saved)


def restore_model(model: torch.nn.Module) -> None:
    """Undo ``make_batch_invariant``: the model's own linear layers and attention again."""
    saved = getattr(model, _SAVED, None)
    if saved is None:
        return
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and "forward" in vars(module):
            del module.forward
    model.set_attn_implementation(saved)  # type: ignore[operator]
    delattr(model, _SAVED)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant_linear(x, self.weight, self.bias)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature around ``invariant_attention``."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "batch-invariant attention does not support attention sinks (s_aux)"
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("batch-invariant attention does not support sliding windows")
    if dropout:
        raise NotImplementedError("batch-invariant attention runs without dropout (eval mode)")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # an additive float mask: 0 where attended
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = invariant_attention(query, key, value, attention_mask, scaling=scale, softcap=softcap)
    return out, None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' boolean mask, always built (never skipped in favour of ``is_causal``)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def use_batch_invariant_kernels(model: torch.nn.Module) -> None:
    """Switch ``model`` to the batch-invariant kernels, after checking they hold here.

    Raises:
        BackendUnavailableError: this machine's kernels are not batch invariant for one of the
            model's shapes (named), or the model cannot take a registered attention function.
    """
    problems = batch_invariance_problems(model)
    if problems:
        raise BackendUnavailableError(
            "batch_invariant is true but on this machine these pieces of the model give a row "
            "different bits in different batches: " + "; ".join(problems) + ". Set "
            "batch_invariant to false, or report the CPU and torch version"
        )
    try:
        make_batch_invariant(model)
    except ValueError as exc:
        raise BackendUnavailableError(f"batch_invariant is true but {exc}") from exc


# Registered once, on import: the name then works wherever transformers looks it up.
AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, _mask)
