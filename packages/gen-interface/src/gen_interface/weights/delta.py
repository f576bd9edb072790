"""Deltas: one tensor sent as what changed since the version its receiver holds, bit for bit.

The one encoding, ``"xor-sparse"``, works on bit patterns, never on float arithmetic: the new
tensor is ``base XOR x``, where ``x`` is zero wherever nothing changed. The delta holds only the
positions where ``x`` is not zero and, at each, ``x`` itself:

- **positions**: the flat tensor cut into blocks of ``block`` elements (256 or 65,536,
  whichever is smaller for the tensor); per block, how many positions changed (``counts``:
  int16 for blocks of 256, int32 for 65,536), then each changed position's offset in its block
  (uint8 or uint16), in order;
- **values**: the low ``planes`` bytes of every ``x``, one byte plane after another, and for the
  few ``x`` that need more bytes (``wide``), their index among the changes (int32) and their
  whole value. Between two optimizer steps a changed bfloat16 value usually moves by a unit or
  two in its last place, so its ``x`` fits in one byte.

At 1% of a bfloat16 tensor's values changed that is about 2 bytes per change and 1.6% of the
tensor's bytes; the README at the package root has the measurements beside the other encodings
tried. A ``TensorDelta`` names the version and the checksum of the base it applies to, and the
checksum of the tensor it makes; ``apply_delta`` checks the payload's structure before writing,
and applying the same delta twice restores the base (XOR is its own inverse), which is how a
receiver undoes one.

Every function here takes contiguous CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import combine_checksums
from gen_interface.weights.chunked import _hash, _run_chunks
from gen_interface.weights.handles import DeltaSlot, dtype_from_name, dtype_name

__all__ = [
    "DELTA_ENCODING",
    "TensorDelta",
    "TensorDiff",
    "apply_delta",
    "apply_diff",
    "decode_delta",
    "diff_tensors",
    "encode_delta",
]

#: The name of the encoding, carried by every delta.
DELTA_ENCODING = "xor-sparse"

_SMALL_BLOCK = 256
_LARGE_BLOCK = 65536
_ALIGN = 8
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDiff:
    """Where ``new`` differs from ``base`` in bits, found in one pass over both.

    Attributes:
        positions: flat indices of the changed elements, ascending.  # int64 [k]
        xors: ``base ^ new`` at those positions, as unsigned integers of the element's width.
            # [k]
        numel, itemsize: the tensors' element count and element size.
        checksum: ``bytes_checksum(new)``, taken during the same pass.
    """

    positions: np.ndarray
    xors: np.ndarray
    numel: int
    itemsize: int
    checksum: int

    @property
    def count(self) -> int:
        return int(self.positions.size)

    @property
    def whole_bytes(self) -> int:
        return self.numel * self.itemsize

    def delta_bytes(self) -> int:
        """The bytes ``encode_delta`` would make of it (its smallest layout)."""
        block, planes, wide = self._layout_choice()
        return _payload_size(self.numel, self.itemsize, self.count, block, planes, wide)

    def _layout_choice(self) -> tuple[int, int, int]:
        """``(block, planes, wide)`` of the smallest layout."""
        count, numel, width = self.count, self.numel, self.itemsize
        small = count + 2 * _blocks(numel, _SMALL_BLOCK)
        large = 2 * count + 4 * _blocks(numel, _LARGE_BLOCK)
        block = _SMALL_BLOCK if small <= large else _LARGE_BLOCK
        best: tuple[int, int, int] | None = None
        for planes in range(1, width + 1):
            wide = 0 if planes == width else int(np.count_nonzero(self.xors >> (8 * planes)))
            size = count * planes + wide * (4 + width)
            if best is None or size < best[0]:
                best = (size, planes, wide)
        assert best is not None
        return block, best[1], best[2]


@dataclass(frozen=True)
class TensorDelta:
    """One tensor as a delta against a base, ready to send.

    Attributes:
        shape, dtype: the whole tensor's.
        payload: the encoded bytes (module docstring).  # uint8 [nbytes]
        count: elements changed; block, planes, wide: the layout (module docstring).
        base_version: the weight version of the base it applies to.
        base_checksum: ``bytes_checksum`` of that base tensor.
        checksum: ``bytes_checksum`` of the tensor it makes: the trainer's own tensor.
    """

    shape: torch.Size
    dtype: torch.dtype
    payload: torch.Tensor
    count: int
    block: int
    planes: int
    wide: int
    base_version: int
    base_checksum: int
    checksum: int

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return int(self.payload.numel())

    @property
    def whole_bytes(self) -> int:
        """Bytes of the whole tensor it stands for."""
        return self.shape.numel() * self.dtype.itemsize

    def describe(self) -> DeltaSlot:
        """The delta's fields as a slot carries them (everything but the payload)."""
        return DeltaSlot(
            encoding=DELTA_ENCODING,
            count=self.count,
            block=self.block,
            planes=self.planes,
            wide=self.wide,
            base_version=self.base_version,
            base_checksum=self.base_checksum,
            checksum=self.checksum,
        )

    @classmethod
    def from_slot(
        cls, payload: torch.Tensor, delta: DeltaSlot, shape: Sequence[int], dtype: str
    ) -> TensorDelta:
        """The delta a slot describes, over its received ``payload`` (no copy).

        Raises:
            WeightUpdateError: another encoding, or fields that do not fit the payload.
        """
        try:
            if delta["encoding"] != DELTA_ENCODING:
                raise WeightUpdateError(
                    f"a delta uses encoding {delta['encoding']!r}; this receiver reads only "
                    f"{DELTA_ENCODING!r}: send the tensor whole"
                )
            out = cls(
                shape=torch.Size(shape),
                dtype=dtype_from_name(dtype),
                payload=payload,
                count=int(delta["count"]),
                block=int(delta["block"]),
                planes=int(delta["planes"]),
                wide=int(delta["wide"]),
                base_version=int(delta["base_version"]),
                base_checksum=int(delta["base_checksum"]),
                checksum=int(delta["checksum"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightUpdateError(f"a delta is malformed: missing or bad field {exc}") from exc
        out.check_layout()
        return out

    def check_layout(self) -> None:
        """Raise ``WeightUpdateError`` unless the fields describe a payload of this size."""
        width, numel = self.dtype.itemsize, self.shape.numel()
        problems = []
        if self.block not in (_SMALL_BLOCK, _LARGE_BLOCK):
            problems.append(f"block {self.block}")
        if not 1 <= self.planes <= width:
            problems.append(f"{self.planes} byte planes for {width}-byte elements")
        if not 0 <= self.wide <= self.count <= numel:
            problems.append(f"{self.count} changes ({self.wide} wide) of {numel} elements")
        if problems:
            raise WeightUpdateError(f"a delta is malformed: {', '.join(problems)}")
        size = _payload_size(numel, width, self.count, self.block, self.planes, self.wide)
        if size != self.nbytes:
            raise WeightUpdateError(
                f"a delta's payload holds {self.nbytes} bytes, its fields describe {size}"
            )


def diff_tensors(base: torch.Tensor, new: torch.Tensor) -> TensorDiff:
    """Where ``new``'s bits differ from ``base``'s, and ``new``'s checksum, in one pass over
    both (on a few threads; each chunk is compared and hashed while in cache).

    Raises:
        ValueError: the tensors differ in shape, dtype or device, or are not contiguous CPU
            tensors.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"a delta needs tensors of one shape and dtype, got {dtype_name(base.dtype)}"
            f"{list(base.shape)} and {dtype_name(new.dtype)}{list(new.shape)}"
        )
    width = new.element_size()
    old_bits, new_bits = _bits(base), _bits(new)
    new_bytes = new_bits.view(np.uint8)

    old_bytes = old_bits.view(np.uint8)

    def chunk(start: int, end: int) -> tuple[int, np.ndarray, np.ndarray]:
        changed, xors = _changes(old_bytes[start:end], new_bytes[start:end], old_bits.dtype)
        return _hash(new_bytes[start:end]), changed + start // width, xors

    results = _run_chunks(new_bytes.size, chunk)
    positions = np.concatenate([r[1] for r in results]) if results else np.zeros(0, np.int64)
    xors = np.concatenate([r[2] for r in results]) if results else np.zeros(0, _UNSIGNED[width])
    return TensorDiff(
        positions=positions.astype(np.int64, copy=False),
        xors=xors,
        numel=new.numel(),
        itemsize=width,
        checksum=combine_checksums(r[0] for r in results),
    )


def encode_delta(
    diff: TensorDiff,
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    base_version: int,
    base_checksum: int,
) -> TensorDelta:
    """The delta of ``diff`` (``diff_tensors(base, new)``), in its smallest layout.

    Args:
        shape, dtype: the tensors'.
        base_version: the version of the weights ``base`` belongs to.
        base_checksum: ``bytes_checksum(base)``.
    """
    block, planes, wide = diff._layout_choice()
    width, count = diff.itemsize, diff.count
    payload = torch.empty(
        _payload_size(diff.numel, width, count, block, planes, wide), dtype=torch.uint8
    )
    parts = _parts(payload, diff.numel, width, count, block, planes, wide, zero_padding=True)
    blocks = diff.positions // block
    parts.counts[:] = np.bincount(blocks, minlength=parts.counts.size).astype(parts.counts.dtype)
    parts.offsets[:] = (diff.positions - blocks * block).astype(parts.offsets.dtype)
    for plane in range(planes):
        parts.planes[plane][:] = ((diff.xors >> (8 * plane)) & 0xFF).astype(np.uint8)
    if wide:
        index = np.flatnonzero(diff.xors >> (8 * planes))
        parts.wide_index[:] = index.astype(np.int32)
        parts.wide_value[:] = diff.xors[index]
    return TensorDelta(
        shape=torch.Size(shape),
        dtype=dtype,
        payload=payload,
        count=count,
        block=block,
        planes=planes,
        wide=wide,
        base_version=base_version,
        base_checksum=base_checksum,
        checksum=diff.checksum,
    )


def apply_delta(target: torch.Tensor, delta: TensorDelta) -> None:
    """XOR ``delta`` into ``target`` in place: the base becomes the new tensor, and applying
    the same delta again gives the base back.

    The payload's structure is checked before anything is written; whether the result is the
    trainer's tensor is the caller's check (``delta.checksum``).

    Raises:
        WeightUpdateError: the delta does not fit ``target`` (shape, dtype) or its payload is
            malformed (positions outside the tensor, wrong sizes); ``target`` is unchanged.
    """
    if tuple(target.shape) != tuple(delta.shape) or target.dtype != delta.dtype:
        raise WeightUpdateError(
            f"a delta of {dtype_name(delta.dtype)}{list(delta.shape)} cannot apply to "
            f"{dtype_name(target.dtype)}{list(target.shape)}"
        )
    positions, xors = decode_delta(delta)
    if positions.size:
        bits = _bits(target)
        bits[positions] ^= xors


def apply_diff(target: torch.Tensor, diff: TensorDiff) -> None:
    """XOR ``diff``'s changes into ``target`` in place (its base becomes its new tensor)."""
    if target.numel() != diff.numel or target.element_size() != diff.itemsize:
        raise ValueError("the diff was taken of tensors of another size")
    if diff.count:
        _bits(target)[diff.positions] ^= diff.xors


def decode_delta(delta: TensorDelta) -> tuple[np.ndarray, np.ndarray]:
    """The changed positions (int64, ascending within each block) and their XORs.

    Raises:
        WeightUpdateError: the payload is malformed.
    """
    delta.check_layout()
    width, numel = delta.dtype.itemsize, delta.shape.numel()
    parts = _parts(delta.payload, numel, width, delta.count, delta.block, delta.planes, delta.wide)
    counts = parts.counts.astype(np.int64)
    if counts.size and (counts.min() < 0 or counts.max() > delta.block):
        raise WeightUpdateError("a delta is malformed: a block counts more changes than elements")
    if int(counts.sum()) != delta.count:
        raise WeightUpdateError(
            f"a delta is malformed: its blocks count {int(counts.sum())} changes, it names "
            f"{delta.count}"
        )
    starts = np.repeat(np.arange(counts.size, dtype=np.int64) * delta.block, counts)
    positions = starts + parts.offsets.astype(np.int64)
    if positions.size and int(positions.max()) >= numel:
        raise WeightUpdateError(
            f"a delta is malformed: it changes position {int(positions.max())} of a tensor of "
            f"{numel} elements"
        )
    unsigned = _UNSIGNED[width]
    xors = np.zeros(delta.count, dtype=unsigned)
    for plane in range(delta.planes):
        xors |= parts.planes[plane].astype(unsigned) << unsigned(8 * plane)
    if delta.wide:
        index = parts.wide_index.astype(np.int64)
        if int(index.min()) < 0 or int(index.max()) >= delta.count:
            raise WeightUpdateError("a delta is malformed: a wide value points past its changes")
        xors[index] = parts.wide_value
    return positions, xors


# ---- layout ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parts:
    counts: np.ndarray
    offsets: np.ndarray
    planes: list[np.ndarray]
    wide_index: np.ndarray
    wide_value: np.ndarray


def _blocks(numel: int, block: int) -> int:
    return (numel + block - 1) // block


def _sizes(
    numel: int, width: int, count: int, block: int, planes: int, wide: int
) -> list[tuple[int, type]]:
    """``(elements, numpy dtype)`` of every part, in payload order."""
    small = block == _SMALL_BLOCK
    return [
        (_blocks(numel, block), np.int16 if small else np.int32),
        (count, np.uint8 if small else np.uint16),
        *[(count, np.uint8)] * planes,
        (wide, np.int32),
        (wide, _UNSIGNED[width]),
    ]


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _payload_size(numel: int, width: int, count: int, block: int, planes: int, wide: int) -> int:
    return sum(
        _aligned(n * np.dtype(kind).itemsize)
        for n, kind in _sizes(numel, width, count, block, planes, wide)
    )


def _parts(
    payload: torch.Tensor,
    numel: int,
    width: int,
    count: int,
    block: int,
    planes: int,
    wide: int,
    zero_padding: bool = False,
) -> _Parts:
    """Views of the payload's parts; ``zero_padding`` zeroes the bytes between them (a payload
    made with ``torch.empty`` whose parts are all about to be written)."""
    raw = payload.numpy()
    views: list[np.ndarray] = []
    offset = 0
    for n, kind in _sizes(numel, width, count, block, planes, wide):
        nbytes = n * np.dtype(kind).itemsize
        views.append(raw[offset : offset + nbytes].view(kind))
        if zero_padding:
            raw[offset + nbytes : offset + _aligned(nbytes)] = 0
        offset += _aligned(nbytes)
    return _Parts(views[0], views[1], views[2 : 2 + planes], views[-2], views[-1])


def _changes(old: np.ndarray, new: np.ndarray, kind: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Where two byte ranges of elements of unsigned type ``kind`` differ: the changed
    elements' indices in the range and their XORs. The XOR and the search for changes run on
    8-byte words (four bfloat16 values at once), then only the changed words are split: at a
    few percent changed that is several times faster than searching every element."""
    width = np.dtype(kind).itemsize
    words = old.size // 8
    per_word = 8 // width
    xors64 = np.bitwise_xor(old[: words * 8].view(np.uint64), new[: words * 8].view(np.uint64))
    changed_words = np.flatnonzero(xors64)
    parts = xors64[changed_words].view(kind).reshape(-1, per_word)
    word, lane = np.nonzero(parts)
    changed, xors = changed_words[word] * per_word + lane, parts[word, lane]
    if old.size > words * 8:  # a range that ends mid-word: the last elements one by one
        tail = old[words * 8 :].view(kind) ^ new[words * 8 :].view(kind)
        at = np.flatnonzero(tail)
        changed = np.concatenate([changed, at + words * per_word])
        xors = np.concatenate([xors, tail[at]])
    return changed, xors


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of their width (a view, no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("deltas take contiguous CPU tensors")
    width = tensor.element_size()
    flat = tensor.detach().reshape(-1).view(_SIGNED[width])
    return flat.numpy().view(_UNSIGNED[width])
