"""The trainer's side of delta refits: a record of what one backend holds.

``SentWeights`` keeps a copy of the weights last sent to a backend, as the backend holds them
(each floating-point tensor cast to the backend's dtype), each one's checksum, and the version the
backend committed them as. A refit then sends each tensor either whole or as a delta against that
copy (``gen_interface.weights.delta``), whichever is smaller, and only when the backend's own copy
(``weight_base()``) has the same version and the same checksum; otherwise every tensor goes
whole, and the record starts again from them.

Memory: one copy of the weights in the backend's dtypes (a bfloat16 model of 112M parameters:
214 MiB), in this process's memory, kept from one refit to the next; while a tensor is encoded,
a cast of it (floating-point weights sent in another dtype) and its changed positions (8 bytes
each). Nothing else grows with refits: there is no history. ``forget()`` frees it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from gen_interface.errors import WeightBaseError
from gen_interface.weights.checksum import combine_checksums, named_checksums
from gen_interface.weights.chunked import copy_with_checksums
from gen_interface.weights.delta import apply_diff, diff_tensors, encode_delta
from gen_interface.weights.handles import WeightBase, dtype_from_name
from gen_interface.weights.layout import Entry

if TYPE_CHECKING:
    from gen_interface.interface import GenerationInterface

__all__ = ["SentWeights"]

logger = logging.getLogger(__name__)


class SentWeights:
    """What one backend holds, as far as this trainer knows: the base of its next deltas.

    Use: ``entries(tensors, backend.weight_base())`` gives what to send, tensor by tensor, and
    updates the record as it goes; after the backend commits, ``committed(version)``. Until then
    (and after any failure) the record is out of step with the backend and the next refit sends
    every tensor whole.
    """

    def __init__(self) -> None:
        #: The version the backend committed the record as; None: not known to match it.
        self.version: int | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._checksums: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the copy held."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def checksum(self) -> int:
        """``named_checksums`` of the record: what the backend's ``WeightBase`` must show."""
        return named_checksums(self._checksums.items())

    def matches(self, base: WeightBase | None) -> bool:
        """Whether ``base`` (the backend's) holds exactly this record's weights."""
        return (
            base is not None
            and self.version is not None
            and base["version"] == self.version
            and base["checksum"] == self.checksum()
        )

    def entries(
        self, tensors: Sequence[tuple[str, torch.Tensor]], base: WeightBase
    ) -> Iterator[tuple[str, Entry]]:
        """Each weight as it goes on the wire, in order, made as it is asked for: the record's
        updated copy (sent whole), or a delta against what the backend holds when it is in step
        with the record and the delta is smaller.

        Floating-point tensors are cast to the backend's dtype (``base["dtypes"]``), as the
        backend would cast them on arrival. A tensor sent whole is the record's own copy, which
        stays as it is until the next refit.

        Raises:
            ValueError: a tensor is not a CPU tensor (deltas are taken in host memory).
        """
        in_step = self.matches(base)
        version = self.version
        self.version = None  # out of step until the backend commits these
        if not in_step:
            self._checksums.clear()
        names = {name for name, _ in tensors}
        for name in list(self._tensors):
            if name not in names:
                del self._tensors[name]
                self._checksums.pop(name, None)
        for name, tensor in tensors:
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"deltas are taken in host memory; {name!r} is on {tensor.device}: send it "
                    "whole (deltas=False) or refit from host tensors"
                )
            wanted = base["dtypes"].get(name)
            dtype = tensor.dtype
            if wanted is not None and tensor.is_floating_point():
                dtype = dtype_from_name(wanted)
            held = self._tensors.get(name)
            if held is None or held.shape != tensor.shape or held.dtype != dtype:
                held = self._tensors[name] = torch.empty(tensor.shape, dtype=dtype)
                self._checksums.pop(name, None)
            new = tensor.detach().to(dtype).contiguous()
            if in_step and version is not None and name in self._checksums:
                diff = diff_tensors(held, new)
                if diff.delta_bytes() < diff.whole_bytes:
                    delta = encode_delta(
                        diff,
                        tensor.shape,
                        dtype,
                        base_version=version,
                        base_checksum=self._checksums[name],
                    )
                    apply_diff(held, diff)
                    self._checksums[name] = diff.checksum
                    yield name, delta
                    continue
                held.copy_(new)
                self._checksums[name] = diff.checksum
            else:
                self._checksums[name] = _copy(held, new)
            yield name, held

    def send(
        self,
        backend: GenerationInterface,
        tensors: Sequence[tuple[str, torch.Tensor]],
        run: Callable[[Iterable[tuple[str, Entry]]], int],
    ) -> int:
        """One refit with deltas where they fit: ``run(entries)`` sends the entries as one
        transaction and returns the committed version.

        Reads ``backend.weight_base()`` first. A backend that keeps no base, or host tensors
        that are not all on the CPU, get ``run(tensors)`` as they are, and nothing is recorded.
        If the backend refuses a delta's base (``WeightBaseError``: its base changed after it
        was read), the same call runs again with every tensor whole.
        """
        base = backend.weight_base()
        if base is None or any(t.device.type != "cpu" for _, t in tensors):
            self.forget()
            return run(tensors)
        try:
            version = run(self.entries(tensors, base))
        except WeightBaseError as exc:
            logger.info("the backend refused a delta's base (%s): sending the weights whole", exc)
            version = run(self.entries(tensors, base))  # out of step now: every tensor whole
        self.committed(version)
        return version

    def committed(self, version: int) -> None:
        """The backend committed every entry of the last ``entries`` as ``version``."""
        self.version = version

    def forget(self) -> None:
        """Drop the record (its memory too); the next refit sends every tensor whole."""
        self.version = None
        self._tensors.clear()
        self._checksums.clear()


def _copy(held: torch.Tensor, new: torch.Tensor) -> int:
    """Copy ``new`` into ``held`` (same dtype and shape); its checksum, taken while copying."""
    into = held.view(-1).view(torch.uint8)
    return combine_checksums(copy_with_checksums(into, new.reshape(-1).view(torch.uint8)))
