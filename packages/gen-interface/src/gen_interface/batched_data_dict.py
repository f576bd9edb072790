"""``BatchedDataDict``: a dict of per-row values that moves through the interface as one batch.

Every value is batched along its first dimension: a tensor ``[B, ...]`` or a list of length ``B``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
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
            raise ValueError(
                "Batch sizes are not the same across the batch's keys (its values disagree on "
                f"the batch size), found sizes: {sizes}"
            )
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
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size is not None and total % batch_size:
            raise ValueError(
                f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})"
            )
        if chunk % shards and not allow_uneven_shards:
            raise ValueError(
                f"Batch size ({chunk}) is not a multiple of shards ({shards}): pass "
                "allow_uneven_shards=True to allow shards of different sizes"
            )
        bounds = _even_bounds(chunk, shards)
        starts = range(0, total, chunk) if chunk else [0]
        return [
            self.select_indices(
                [i for s in starts for i in range(s + bounds[k], s + bounds[k + 1])]
            )
            for k in range(shards)
        ]

    def get_dict(self) -> dict[str, Any]:
        """A plain ``dict`` holding the same values (a shallow copy; NeMo RL returns its own)."""
        return dict(self)

    def chunk(self, rank: int, chunks: int) -> BatchedDataDict[DictT]:
        """Contiguous part ``rank`` of ``chunks``: rows ``[rank*n, (rank+1)*n)``, ``n = B/chunks``.

        Tensors are cloned, lists copied. NeMo RL asserts ``B // chunks > rank``, which refuses
        parts that exist (``B=4, chunks=4, rank=1``); this checks ``0 <= rank < chunks`` instead.

        Raises:
            ValueError: ``chunks < 1``, ``rank`` outside ``[0, chunks)``, or ``B % chunks != 0``.
        """
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if not 0 <= rank < chunks:
            raise ValueError(f"rank must be in [0, {chunks}), got {rank}")
        total = self.size
        if total % chunks:
            raise ValueError(f"batch size {total} is not a multiple of chunks={chunks}")
        part = self.slice(rank * (total // chunks), (rank + 1) * (total // chunks))
        return type(self)(
            {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in part.items()}
        )

    def reorder_data(self, reordered_indices: Sequence[int] | torch.Tensor) -> None:
        """In place, move row ``i`` to position ``reordered_indices[i]`` (a scatter, as NeMo RL).

        This undoes a gather: after ``b = a.select_indices(p)``, ``b.reorder_data(p)`` gives ``a``.

        Raises:
            ValueError: ``reordered_indices`` is not a permutation of ``range(B)``.
        """
        if isinstance(reordered_indices, torch.Tensor):
            reordered_indices = reordered_indices.reshape(-1).tolist()
        order = [operator.index(i) for i in reordered_indices]
        total = self.size
        if sorted(order) != list(range(total)):
            raise ValueError(
                f"reordered_indices must be a permutation of range({total}), "
                f"got {len(order)} indices starting {order[:8]}"
            )
        source = [0] * total  # source[j] is the row that lands at position j
        for i, j in enumerate(order):
            source[j] = i
        index = torch.tensor(source, dtype=torch.long)
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.index_select(0, index.to(value.device))
            else:
                self[key] = [value[i] for i in source]

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> BatchedDataDict[DictT]:
        """Rows ``[batch_size*batch_idx, batch_size*(batch_idx+1))`` (views for tensors).

        NeMo RL's non-packing path; ``batch_size`` is required there too (``None`` fails).

        Raises:
            ValueError: ``batch_size`` missing or < 1, or the batch does not lie within ``B`` rows.
        """
        if batch_size is None or batch_size < 1:
            raise ValueError(f"get_batch needs a batch_size >= 1, got {batch_size}")
        total = self.size
        if batch_idx < 0 or batch_size * (batch_idx + 1) > total:
            raise ValueError(
                f"batch_idx {batch_idx} out of range: {total} rows hold "
                f"{total // batch_size} batches of {batch_size}"
            )
        return self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """In place, keep the first ``truncated_len`` entries along ``dim`` of every tensor.

        Tensors with ``dim`` or fewer dimensions, and lists, are untouched; the result is a view
        (``torch.narrow``). Everything is checked before anything changes.

        Raises:
            ValueError: ``dim < 0``, ``truncated_len < 0``, or a tensor shorter than
                ``truncated_len`` along ``dim``.
        """
        if dim < 0 or truncated_len < 0:
            raise ValueError(f"dim and truncated_len must be >= 0, got {dim}, {truncated_len}")
        targets = [k for k, v in self.items() if isinstance(v, torch.Tensor) and v.dim() > dim]
        for key in targets:
            if self[key].shape[dim] < truncated_len:
                raise ValueError(
                    f"{key!r} has {self[key].shape[dim]} entries on dim {dim}, "
                    f"cannot truncate to {truncated_len}"
                )
        for key in targets:
            self[key] = torch.narrow(self[key], dim, 0, truncated_len)

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict[DictT]]:
        """Consecutive slices of ``microbatch_size`` rows (views), ``B / microbatch_size`` of them.

        Arguments are checked when called, not at the first ``next``.

        Raises:
            ValueError: ``microbatch_size < 1`` or ``B`` not a multiple of it.
        """
        total = self.size
        if microbatch_size < 1 or total % microbatch_size:
            raise ValueError(
                f"batch size {total} is not a multiple of microbatch_size={microbatch_size}"
            )
        return (self.slice(i, i + microbatch_size) for i in range(0, total, microbatch_size))

    def all_gather(self, group: dist.ProcessGroup | None = None) -> BatchedDataDict[DictT]:
        """Every rank's rows, concatenated in rank order, on every rank of ``group``.

        A collective: every rank of ``group`` must call it. Ranks may hold different ``B``;
        tensors are gathered on their own device (CPU with gloo, CUDA with nccl) after padding
        dim 0 to the largest ``B``, then trimmed. Lists travel through ``all_gather_object`` and
        come back flattened. The keys, kinds, dtypes and trailing shapes are exchanged first, so
        a mismatch raises the same error on every rank instead of hanging a collective.

        Raises:
            TypeError: a value on any rank is neither a tensor nor a list/tuple.
            ValueError: the ranks disagree on keys, on a key's kind or dtype, or on a tensor's
                trailing dims; or a tensor is 0-d.
        """
        world = dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {k: _describe(v) for k, v in self.items()}, group=group)
        metas: list[dict[str, tuple[Any, ...]]] = gathered
        keys = list(metas[0])  # rank 0's order, so every rank runs the collectives alike
        out: dict[str, Any] = {}
        for rank, meta in enumerate(metas):
            if set(meta) != set(keys):
                raise ValueError(f"rank {rank} has keys {sorted(meta)}, rank 0 has {sorted(keys)}")
        for key in keys:
            descs = [meta[key] for meta in metas]
            for rank, desc in enumerate(descs):
                if desc[0] == "other":
                    raise TypeError(
                        f"all_gather: {key!r} on rank {rank} is a {desc[1]}; use a tensor or a list"
                    )
            if len({d[0] for d in descs}) > 1:
                raise ValueError(f"all_gather: {key!r} is a tensor on some ranks, a list on others")
            if descs[0][0] == "list":
                out[key] = [item for d in descs for item in d[1]]
                continue
            if any(len(d[1]) == 0 for d in descs) or len({(d[1][1:], d[2]) for d in descs}) > 1:
                raise ValueError(
                    f"all_gather: {key!r} needs dims >= 1 and the same trailing shape and dtype "
                    f"on every rank, got (shape, dtype) {[(d[1], d[2]) for d in descs]}"
                )
            out[key] = _gather_jagged(self[key], [d[1][0] for d in descs], group)
        return type(self)(out)

    @classmethod
    def from_batches(
        cls,
        batches: Iterable[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float | bool] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate batches along the batch dimension, in the order given.

        Tensors whose trailing dimensions differ are right-padded to the largest size in each
        dimension with ``pad_value_dict[key]`` (0 when the key is not named). Every batch with
        rows must hold the same keys; an empty batch (no rows, or no keys at all) may lack keys
        the others have, as NeMo RL's rollouts produce when a worker got no rows.

        Raises:
            ValueError: a batch with rows lacks a key another batch has, or has one more.
        """
        given: list[BatchedDataDict[Any]] = [
            b if isinstance(b, BatchedDataDict) else BatchedDataDict(b) for b in batches
        ]
        if not given:
            return cls()
        filled = [b for b in given if b.size > 0]
        keys = list(dict.fromkeys(k for b in (filled or given) for k in b))
        for i, batch in enumerate(given):
            if batch.size == 0:
                continue
            missing = [k for k in keys if k not in batch]
            if missing:
                raise ValueError(
                    f"batch {i} has {batch.size} rows but no {missing} (other batches have "
                    f"{'it' if len(missing) == 1 else 'them'}); only an empty batch may lack keys"
                )
        pads = pad_value_dict or {}
        out: dict[str, Any] = {}
        for key in keys:  # empty values add no rows; with rows elsewhere, they are left out
            values = [batch[key] for batch in (filled or given) if key in batch]
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


def _describe(value: Any) -> tuple[Any, ...]:
    """What ``all_gather`` exchanges first about a value: its kind and, for lists, the items."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, list | tuple):
        return ("list", list(value))
    return ("other", type(value).__name__)


def _gather_jagged(
    tensor: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (``[sizes[rank], ...]``) in rank order."""
    longest = max(sizes)
    if longest == 0:
        return tensor.new_empty((0, *tensor.shape[1:]))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)


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
