"""The ceiling of a streamed, verified refit on this machine: the copies and checksums alone.

A streamed refit must move every byte twice (the trainer's tensor into a bucket, the bucket into
the model) and check it once on each side. These runs do exactly that with the project's fused
chunk kernels (``gen_interface.weights.chunked``: copy then hash each 1 MiB chunk while it is in
cache; hash then copy on the reading side), double-buffered with one loading thread as
``Refitter`` does, and nothing else: no handles, no transaction, no backend, no names. No refit
through buckets can be faster here, so a target above these ratios is a target for another
machine.

Two shapes:

- ``whole tensors``: buckets of the given size that grow to hold a tensor larger than that, as
  ``Refitter`` lays them out. The bucket is written to and read back from DRAM.
- ``split, fits L3``: small buckets that never grow (tensors cut across buckets as flat bytes),
  so a bucket can still be in the last-level cache when it is read back: the best any bucketed
  design could do. (The project's handles carry whole tensors: vLLM's loader takes whole
  tensors.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from gen_interface.weights.chunked import chunk_checksums, copy_with_checksums, verified_copy
from gen_interface.weights.layout import plan_buckets

__all__ = ["ceiling_paths", "verified_reload_floor"]

MIB = 2**20


def ceiling_paths(
    targets: dict[str, torch.Tensor], bucket_bytes: int
) -> dict[str, Callable[[dict[str, torch.Tensor]], None]]:
    """The two streamed copies, each a call that copies a state dict into ``targets`` (same
    names, shapes and dtypes) as one refit would; ``bucket_bytes`` sizes the whole-tensor
    buckets."""
    largest = max(_flat(t).numel() for t in targets.values())
    whole = _Stream(max(bucket_bytes, largest))
    split = _Stream(8 * MIB)

    def pairs(weights: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(_flat(tensor), _flat(targets[name])) for name, tensor in weights.items()]

    return {
        f"ceiling, 2 x {bucket_bytes // MIB} MiB": lambda weights: whole.run(
            [
                [(_flat(tensor), _flat(targets[name])) for name, tensor in group]
                for group in plan_buckets(list(weights.items()), bucket_bytes)
            ]
        ),
        "ceiling, 2 x 8 MiB split": lambda weights: split.run(
            list(_split_buckets(pairs(weights), 8 * MIB))
        ),
    }


def verified_reload_floor(
    reload: Callable[[dict[str, torch.Tensor]], None], bucket_bytes: int
) -> Callable[[dict[str, torch.Tensor]], None]:
    """The floor of a verified, streamed refit into vLLM: every byte copied into a bucket with
    its checksums and checked again on the reading side (the two passes such a refit adds), then
    bare vLLM's own ``reload`` of the same tensors; one after the other, as they run on two
    cores, with no Ray, handles or transaction. It does less than any such refit: the reload
    reads the original tensors, not the bucket."""
    bucket = [torch.zeros(bucket_bytes, dtype=torch.uint8)]  # one: its loads follow each fill

    def run(weights: dict[str, torch.Tensor]) -> None:
        largest = max(_flat(tensor).numel() for tensor in weights.values())
        if largest > bucket[0].numel():  # a bucket grows to hold the largest tensor
            bucket[0] = torch.zeros(largest, dtype=torch.uint8)
        for group in plan_buckets(list(weights.items()), bucket_bytes):  # as a refit lays out
            offset = 0
            for _, tensor in group:
                source = _flat(tensor)
                view = bucket[0][offset : offset + source.numel()]
                written = copy_with_checksums(view, source)
                if chunk_checksums(view) != written:
                    raise AssertionError("a bucket changed while it was read back")
                offset += source.numel()
        reload(weights)

    return run


#: One bucket's pieces: (source bytes, target bytes), laid out one after another in the bucket.
Pieces = list[tuple[torch.Tensor, torch.Tensor]]


class _Stream:
    """Two buckets of ``capacity`` bytes: one is filled while the other is read back."""

    def __init__(self, capacity: int):
        self.buckets = [torch.zeros(capacity, dtype=torch.uint8) for _ in range(2)]
        self.loader = ThreadPoolExecutor(1)

    def run(self, buckets: list[Pieces]) -> None:
        pending: list[Future[None]] = []
        for index, pieces in enumerate(buckets):
            if len(pending) == 2:  # the bucket to fill is still being read
                pending.pop(0).result()
            bucket = self.buckets[index % 2]
            filled = []
            offset = 0
            for source, target in pieces:
                view = bucket[offset : offset + source.numel()]
                filled.append((view, target, copy_with_checksums(view, source)))
                offset += source.numel()
            pending.append(self.loader.submit(_read_back, filled))
        for future in pending:
            future.result()


def _read_back(filled: list[tuple[torch.Tensor, torch.Tensor, list[int]]]) -> None:
    for view, target, checksums in filled:
        verified_copy(target, view, checksums, "weight")


def _split_buckets(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], bucket_bytes: int
) -> Iterator[Pieces]:
    """The tensors' bytes in order, cut into buckets of exactly ``bucket_bytes`` (the last
    shorter)."""
    pieces: Pieces = []
    room = bucket_bytes
    for source, target in pairs:
        start = 0
        while start < source.numel():
            take = min(room, source.numel() - start)
            pieces.append((source[start : start + take], target[start : start + take]))
            start += take
            room -= take
            if room == 0:
                yield pieces
                pieces, room = [], bucket_bytes
    if pieces:
        yield pieces


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)
