"""The changes between two versions of a trainer's weights, as the delta benchmarks make and count
them (``delta_refit.py``, ``refit.py``).

- ``changed_share``: the share of values whose bits differ between two versions: what a delta
  refit has to carry (deltas are bit-for-bit, ``gen_interface.weights.delta``).
- ``perturbed``: a copy of some weights with a fixed share of each tensor's values moved by a
  small step, at seeded random positions: one optimizer step's worth of change where a real step
  cannot be taken or would change every value (float32 weights: an AdamW step moves almost every
  value by some bits, and a delta of every value is larger than the tensor).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: Integer views of each element size, to compare values bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_share(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> float:
    """The share of all values of ``after`` whose bits differ from ``before`` (same names,
    shapes and dtypes on both sides)."""
    changed = total = 0
    for name, new in after.items():
        bits = _BITS[new.element_size()]
        changed += int((new.view(bits) != before[name].view(bits)).sum())
        total += new.numel()
    return changed / max(total, 1)


def perturbed(
    weights: Mapping[str, torch.Tensor], share: float, step: float, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` in which ``share`` of every floating-point tensor's values (at
    least one per tensor) move by ``step`` up or down, at random positions drawn from ``seed``.

    Positions are drawn with replacement, so a few repeat: the share changed is a little under
    ``share`` (``changed_share`` counts it). Other tensors are copied as they are.
    """
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        copy = tensor.detach().clone().contiguous()
        if copy.is_floating_point() and copy.numel():
            flat = copy.view(-1)
            count = max(1, round(share * flat.numel()))
            positions = torch.randint(flat.numel(), (count,), generator=generator)
            signs = torch.randint(2, (count,), generator=generator).to(flat.dtype) * 2 - 1
            flat[positions] += step * signs
        out[name] = copy
    return out
