"""``BatchedDataDict``: a dict of per-row values that moves through the interface as one batch.

Every value is batched along its first dimension: a tensor ``[B, ...]`` or a list of length ``B``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

__all__ = ["BatchedDataDict"]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(dict[str, Any], Generic[DictT]):
    """A ``dict`` whose values share a batch dimension.

    The type parameter names the TypedDict the keys follow
    (``BatchedDataDict[GenerationDatumSpec]``); it documents, it does not check.
    Values are tensors batched on dim 0 or lists of length ``B``.
    """

    @property
    def size(self) -> int:
        """The batch size ``B``.

        Raises:
            ValueError: the values disagree on the batch size, or one is neither tensor nor list.
        """
        sizes = {key: _batch_len(key, value) for key, value in self.items()}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            raise ValueError(f"BatchedDataDict values disagree on the batch size: {sizes}")
        return distinct.pop() if distinct else 0

    def slice(self, start: int, end: int) -> BatchedDataDict[DictT]:
        """Rows ``start:end`` of every value (views for tensors)."""
        return type(self)({key: value[start:end] for key, value in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[DictT]:
        """Rows at ``indices``, in that order (repeats allowed)."""
        index = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        rows = index.tolist()
        out: dict[str, Any] = {}
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.index_select(0, index.to(value.device))
            else:
                out[key] = [value[i] for i in rows]
        return type(self)(out)

    def repeat_interleave(self, repeats: int) -> BatchedDataDict[DictT]:
        """Each row repeated ``repeats`` times in place: rows ``a, b`` become ``a, a, b, b``."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        return self.select_indices(torch.arange(self.size).repeat_interleave(repeats))

    def to(self, device: str | torch.device) -> BatchedDataDict[DictT]:
        """A copy with every tensor moved to ``device``; lists are shared."""
        return type(self)(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()}
        )

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
    ) -> list[BatchedDataDict[DictT]]:
        """Split the rows into ``shards`` parts, one per worker.

        Without ``batch_size`` the rows are cut into ``shards`` contiguous runs whose sizes differ
        by at most one (the first ``B % shards`` runs hold one more row), so
        ``from_batches(shards)`` gives back the batch in order. With ``batch_size``, the batch is
        first cut into consecutive chunks of ``batch_size`` rows and each chunk is split across the
        shards in the same way; shard ``k`` holds its part of every chunk, in chunk order.

        Args:
            shards: number of parts, >= 1. Parts may be empty when ``B < shards``.
            batch_size: optional chunk size; ``B`` must be a multiple of it.
            allow_uneven_shards: permit parts of different sizes; without it a size that does not
                divide evenly raises.

        Raises:
            ValueError: bad ``shards`` or ``batch_size``, or an uneven split that is not allowed.
        """
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        total = self.size
        chunk = total if batch_size is None else batch_size
        if batch_size is not None and (batch_size < 1 or total % batch_size):
            raise ValueError(f"batch size {total} is not a multiple of batch_size={batch_size}")
        if chunk % shards and not allow_uneven_shards:
            raise ValueError(
                f"{chunk} rows do not split evenly into {shards} shards; "
                "pass allow_uneven_shards=True to allow shards of different sizes"
            )
        bounds = _even_bounds(chunk, shards)
        starts = range(0, total, chunk) if chunk else [0]
        return [
            self.select_indices(
                [i for s in starts for i in range(s + bounds[k], s + bounds[k + 1])]
            )
            for k in range(shards)
        ]

    @classmethod
    def from_batches(
        cls,
        batches: Iterable[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float | bool] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate batches along the batch dimension, in the order given.

        Tensors whose trailing dimensions differ are right-padded to the largest size in each
        dimension with ``pad_value_dict[key]`` (0 when the key is not named). Every batch must
        hold the same keys.

        Raises:
            ValueError: the batches do not hold the same keys.
        """
        batches = list(batches)
        if not batches:
            return cls()
        keys = list(batches[0].keys())
        for i, batch in enumerate(batches):
            if set(batch.keys()) != set(keys):
                raise ValueError(
                    f"batch {i} has keys {sorted(batch.keys())}, batch 0 has {sorted(keys)}"
                )
        pads = pad_value_dict or {}
        out: dict[str, Any] = {}
        for key in keys:
            values = [batch[key] for batch in batches]
            if isinstance(values[0], torch.Tensor):
                out[key] = _cat_padded(values, pads.get(key, 0))
            else:
                out[key] = [item for value in values for item in value]
        return cls(out)


def _batch_len(key: str, value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"BatchedDataDict value {key!r} is a 0-d tensor; it has no batch dim")
        return int(value.shape[0])
    if isinstance(value, list | tuple):
        return len(value)
    raise ValueError(
        f"BatchedDataDict value {key!r} is a {type(value).__name__}; use a tensor or a list"
    )


def _even_bounds(total: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous runs over ``total`` rows, sizes differing by <= 1."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def _cat_padded(tensors: list[torch.Tensor], pad_value: int | float | bool) -> torch.Tensor:
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        widths: list[int] = []
        for d in reversed(range(1, t.dim())):
            widths += [0, shape[d - 1] - t.shape[d]]
        padded.append(F.pad(t, widths, value=pad_value) if any(widths) else t)
    return torch.cat(padded, dim=0)
