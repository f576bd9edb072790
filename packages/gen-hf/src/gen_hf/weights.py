"""Writing new weights into a loaded model, after they were checked against it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["model_tensor_specs", "tied_aliases", "write_weights"]


def model_tensor_specs(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{name: (shape, dtype)}`` of every tensor of ``model.state_dict()``.

    These are the checkpoint (Hugging Face) names an update carries. Tied weights appear under
    each of their names (e.g. ``model.embed_tokens.weight`` and ``lm_head.weight``), so an update
    may use either.
    """
    return {name: (t.shape, t.dtype) for name, t in model.state_dict().items()}


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of ``model.state_dict()`` that share their memory with an earlier name (e.g.
    ``lm_head.weight`` tied to ``model.embed_tokens.weight``): an update may omit them."""
    seen: set[tuple[int, int]] = set()
    aliases = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def write_weights(
    targets: Mapping[str, torch.Tensor], tensors: Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy each ``(name, tensor)`` into ``targets[name]`` (a model's ``state_dict()``), in place.

    The caller has checked names, shapes and dtypes (``check_weights_match``). Tensors on
    another device (shared-memory CPU buckets for a CUDA model) are copied across, and
    floating-point tensors of another dtype are cast.

    Returns:
        The number of tensors written.
    """
    written = 0
    with torch.no_grad():
        for name, tensor in tensors:
            targets[name].copy_(tensor)
            written += 1
    return written
