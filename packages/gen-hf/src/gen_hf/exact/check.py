"""Checking, on this machine, that the batch-invariant kernels keep their promise for a model.

The kernels rest on a measured property of the matrix multiply underneath (the same row gives
the same bits for any number of rows from ``MIN_ROWS`` up), not on a documented one. So a model
is checked before it is trusted: each distinct linear shape against slices of a larger batch,
and the attention against itself decoded one query at a time from padded caches. The check costs
a few small multiplies per shape (milliseconds for the test models, well under a second for 1B).
"""

from __future__ import annotations

import torch

from gen_hf.exact.kernels import invariant_attention, invariant_linear

__all__ = ["batch_invariance_problems"]

# (offset, rows) slices compared with the same rows inside a batch of _ROWS.
_SLICES = ((0, 1), (3, 2), (5, 7), (0, 16), (1, 17), (7, 33))
_ROWS = 48


def batch_invariance_problems(model: torch.nn.Module) -> list[str]:
    """What in ``model`` would not be batch invariant on this machine; empty when all is.

    Args:
        model: a transformers causal LM (its ``config`` names the attention shape), on the
            device and in the dtype it will run with.

    Returns:
        One line per failing piece, naming its shape and dtype.
    """
    problems: list[str] = []
    seen: set[tuple[tuple[int, ...], torch.dtype, torch.device]] = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            weight = module.weight
            key = (tuple(weight.shape), weight.dtype, weight.device)
            if key in seen:
                continue
            seen.add(key)
            if not _linear_is_invariant(weight.shape, weight.dtype, weight.device):
                problems.append(
                    f"linear layer {name} ({weight.shape[1]} -> {weight.shape[0]}, "
                    f"{weight.dtype}) on {weight.device}"
                )
        config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        parameter = next(model.parameters())
        if not _attention_is_invariant(heads, kv_heads, dim, parameter.dtype, parameter.device):
            problems.append(
                f"attention ({heads} heads, {kv_heads} key/value heads, head size {dim}, "
                f"{parameter.dtype}) on {parameter.device}"
            )
    return problems


def _linear_is_invariant(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """Random inputs and weights of ``shape`` (the model's own may not be loaded yet)."""
    generator = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(shape, generator=generator, device=device).to(dtype)
    x = torch.randn(_ROWS, shape[1], generator=generator, device=device).to(dtype)
    full = invariant_linear(x, weight)
    return all(
        torch.equal(invariant_linear(x[start : start + rows], weight), full[start : start + rows])
        for start, rows in _SLICES
    )


def _attention_is_invariant(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Rows of lengths crossing a slot block, read at once (right padding) and decoded one
    query at a time from left-padded caches of other widths, give the same bits."""
    generator = torch.Generator(device=device).manual_seed(0)
    lengths = (5, 70, 13)
    width = max(lengths)

    def draw(h: int) -> torch.Tensor:
        shape = (len(lengths), h, width, dim)
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    query, key, value = draw(heads), draw(kv_heads), draw(kv_heads)
    positions = torch.arange(width, device=device)
    real = positions[None, :] < torch.tensor(lengths, device=device)[:, None]  # [R, T]
    attends = (positions[None, :, None] >= positions[None, None, :]) & real[:, None, :]
    full = invariant_attention(query, key, value, attends[:, None], scaling=dim**-0.5)
    for row, length in enumerate(lengths):
        for t in sorted({0, length // 2, length - 1}):
            pad = 3 + row
            k = torch.cat([key.new_zeros(1, kv_heads, pad, dim), key[row : row + 1, :, : t + 1]], 2)
            v = torch.cat(
                [value.new_zeros(1, kv_heads, pad, dim), value[row : row + 1, :, : t + 1]], 2
            )
            mask = torch.ones(1, 1, 1, pad + t + 1, dtype=torch.bool, device=device)
            mask[..., :pad] = False
            q = query[row : row + 1, :, t : t + 1]
            one = invariant_attention(q, k, v, mask, scaling=dim**-0.5)
            if not torch.equal(one[0, 0], full[row, t]):
                return False
    return True
