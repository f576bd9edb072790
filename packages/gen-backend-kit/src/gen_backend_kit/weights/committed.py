"""``CommittedWeights``: a readable copy of the last committed weights, kept for the purpose.

Two uses, one copy: the base that deltas apply to (``gen_interface.weights.delta``), and the
weights a replica that has none (a replacement in a fleet, a restarted worker) is loaded from
(``items()``). A backend whose model can give its weights back by name keeps it as views of the
model's own tensors, at no cost; one whose engine keeps them where no tensor can give them back
(vLLM's CPU linear layers pack theirs into oneDNN buffers) keeps a copy of its own.

Every update runs through it: ``begin``, then per tensor ``write`` (whole) or ``apply`` (a
delta), then ``commit`` or ``rollback``.

- A delta is refused before anything of it is written (``WeightBaseError``) unless it names
  this copy's version and the checksum of this copy's tensor. It is applied in place (an XOR),
  and the tensor it makes is checked against the trainer's checksum right away; a mismatch
  undoes it (the same XOR again) and raises, so no tensor that differs from the trainer's is
  ever left behind, let alone committed.
- ``rollback`` undoes every delta of the update in reverse order. A tensor written whole cannot
  be undone: the copy then holds no base (``version`` None) until a complete update commits,
  and every tensor of that one must come whole.

Memory: an owned copy holds each weight once, in the model's dtype (``nbytes``: the model's
size), allocated as whole tensors first arrive and never more: deltas apply in place, and the
undo of an update is its deltas themselves. Views hold nothing.

Not thread-safe: its owner serialises updates (a worker's one engine thread; an in-process
backend's gate lock).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from gen_interface.errors import WeightBaseError, WeightUpdateError
from gen_interface.weights.checksum import bytes_checksum, named_checksums
from gen_interface.weights.delta import TensorDelta, apply_delta
from gen_interface.weights.handles import WeightBase, dtype_name

__all__ = ["CommittedWeights"]


class CommittedWeights:
    """The last committed weights by checkpoint name, readable; see the module docstring.

    Build it with ``owning`` or ``viewing``.

    Attributes:
        version: the committed version the copy holds; None while it holds none (an owned copy
            before its first complete update, or after an update it could not undo).
    """

    def __init__(
        self,
        specs: Mapping[str, tuple[torch.Size, torch.dtype]],
        tensors: Mapping[str, torch.Tensor],
        *,
        owned: bool,
        version: int | None,
    ):
        self.specs = dict(specs)
        self.owned = owned
        self.version = version
        self._tensors: dict[str, torch.Tensor] = dict(tensors)
        self._names: list[str] = list(tensors)  # the base: what the last commit held
        self._checksums: dict[str, int] = {}
        self._applied: list[tuple[str, TensorDelta, int | None]] = []  # this update's deltas
        self._whole: set[str] = set()  # written whole in this update
        self._written: list[str] = []

    @classmethod
    def owning(cls, specs: Mapping[str, tuple[torch.Size, torch.dtype]]) -> CommittedWeights:
        """An empty copy of its own, for a model of ``specs`` (``{name: (shape, dtype)}``)."""
        return cls(specs, {}, owned=True, version=None)

    @classmethod
    def viewing(
        cls, tensors: Mapping[str, torch.Tensor], version: int | None = 0
    ) -> CommittedWeights:
        """Views of a model's own host tensors (contiguous, on the CPU), at ``version``.

        Raises:
            ValueError: a tensor is not a contiguous CPU tensor (deltas apply in host memory).
        """
        for name, tensor in tensors.items():
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"{name!r} is not a contiguous CPU tensor: keep an owned copy")
        specs = {name: (t.shape, t.dtype) for name, t in tensors.items()}
        return cls(specs, tensors, owned=False, version=version)

    @property
    def nbytes(self) -> int:
        """Memory this copy holds of its own (0 for views)."""
        if not self.owned:
            return 0
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def base(self) -> WeightBase:
        """What a trainer needs to send deltas here: version, checksum, dtypes.

        Views are hashed anew at every call (a pass over the model: the model is the truth,
        whatever wrote to it); an owned copy hashes only tensors it has no checksum of yet.
        """
        dtypes = {name: dtype_name(dtype) for name, (_, dtype) in self.specs.items()}
        if self.version is None:
            return WeightBase(version=None, checksum=0, dtypes=dtypes)
        if not self.owned:
            self._checksums.clear()
        checksums = ((name, self._checksum(name)) for name in self._names)
        return WeightBase(version=self.version, checksum=named_checksums(checksums), dtypes=dtypes)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the copy, by name, in the order the last commit wrote them: what a
        replica without weights is loaded from (read them while no update runs)."""
        for name in self._names:
            yield name, self._tensors[name]

    def staged_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors the update in progress wrote (whole or by a delta), by name, in the order
        written: what a backend that stages updates here loads into its engine at the commit.
        (``items()`` is the last commit's: for the first update of an empty copy, nothing.)"""
        for name in dict.fromkeys(self._written):
            yield name, self._tensors[name]

    # ---- an update ------------------------------------------------------------------------

    def begin(self) -> None:
        """An update starts (any update left open is forgotten, not undone)."""
        self._applied = []
        self._whole = set()
        self._written = []

    def check_base(self, name: str, delta: TensorDelta) -> None:
        """Refuse ``delta`` unless it applies to this copy's ``name``: same version, same bytes.

        Raises:
            WeightBaseError: naming what differs; nothing was written.
        """
        if self.version is None:
            raise WeightBaseError(
                f"weight {name!r} arrived as a delta against version {delta.base_version}, but "
                "this receiver holds no base (nothing committed into its copy yet, or an update "
                "it could not undo): nothing was written; send the weights whole"
            )
        if delta.base_version != self.version:
            newer = "newer" if delta.base_version > self.version else "older"
            raise WeightBaseError(
                f"weight {name!r} arrived as a delta against version {delta.base_version} "
                f"({newer} than this receiver's {self.version}: a version was skipped or the "
                "trainer's record is stale): nothing was written; send the weights whole"
            )
        if name not in self._tensors or name not in self._names:
            raise WeightBaseError(
                f"weight {name!r} arrived as a delta, but the last committed update did not "
                "carry it: nothing was written; send it whole"
            )
        if name in self._whole or any(n == name for n, _, _ in self._applied):
            raise WeightUpdateError(f"weight {name!r} arrived twice in one update")
        if self._checksum(name) != delta.base_checksum:
            raise WeightBaseError(
                f"weight {name!r} arrived as a delta against other bytes than this receiver's "
                f"version {self.version} holds (base checksum mismatch): nothing was written; "
                "send the weights whole"
            )

    def apply(self, name: str, delta: TensorDelta) -> torch.Tensor:
        """Apply ``delta`` to ``name`` in place and check the tensor it makes.

        Returns:
            The tensor made (the copy's own, or the model's for views).

        Raises:
            WeightBaseError: ``check_base`` refused it; nothing was written.
            WeightUpdateError: the delta is malformed (nothing was written), or the tensor it
                made is not the trainer's (undone before this returns).
        """
        target = self._tensors.get(name)
        if target is not None and self._alias_written(name, target):
            # a tied weight whose memory an earlier tensor of this update already rewrote
            if bytes_checksum(target) != delta.checksum:
                raise WeightUpdateError(
                    f"weight {name!r} is tied to a weight of this update, whose new values "
                    "differ from the ones its delta makes"
                )
            self._checksums[name] = delta.checksum
            self._written.append(name)
            return target
        self.check_base(name, delta)
        target = self._tensors[name]
        apply_delta(target, delta)
        made = bytes_checksum(target)
        if made != delta.checksum:
            apply_delta(target, delta)  # XOR again: the base is back
            raise WeightUpdateError(
                f"weight {name!r}: the tensor its delta makes differs from the trainer's "
                "(checksum mismatch after applying it; the delta is damaged or was taken "
                "against other bytes). It was undone: nothing of it is kept"
            )
        self._applied.append((name, delta, self._checksums.get(name)))
        self._checksums[name] = made
        self._written.append(name)
        return target

    def write(self, name: str, tensor: torch.Tensor, checksum: int | None = None) -> torch.Tensor:
        """``name`` arrives whole: an owned copy copies it in (cast to the model's dtype); views
        take note that the backend wrote the model's tensor itself.

        Args:
            checksum: ``bytes_checksum`` of the bytes as they are now held, when known (the
                producer's, for a tensor that arrived in the model's dtype).

        Returns:
            The tensor held for ``name``.
        """
        if name in self._whole or any(n == name for n, _, _ in self._applied):
            raise WeightUpdateError(f"weight {name!r} arrived twice in one update")
        held = self._tensors.get(name)
        if self.owned:
            shape, dtype = self.specs.get(name, (tensor.shape, tensor.dtype))
            if held is None or held.shape != shape or held.dtype != dtype:
                held = self._tensors[name] = torch.empty(shape, dtype=dtype)
            with torch.no_grad():
                held.copy_(tensor)
            if tensor.dtype != held.dtype:
                checksum = None
        elif held is None:
            raise WeightUpdateError(f"weight {name!r} is not one of the model's")
        self._whole.add(name)
        self._written.append(name)
        if checksum is None:
            self._checksums.pop(name, None)
        else:
            self._checksums[name] = checksum
        return held

    def commit(self, version: int) -> None:
        """The update committed as ``version``: the copy is now its weights."""
        if self._written:
            written = dict.fromkeys(self._written)
            if self.owned:
                for name in list(self._tensors):
                    if name not in written:
                        del self._tensors[name]
                        self._checksums.pop(name, None)
            self._names = list(written)
        self.version = version
        self.begin()

    def rollback(self) -> bool:
        """The update was dropped: undo its deltas, newest first.

        Returns:
            True when the copy holds its committed weights again; False when a tensor was
            written whole (the copy then holds no base: ``version`` None).
        """
        for name, delta, checksum in reversed(self._applied):
            apply_delta(self._tensors[name], delta)
            if checksum is None:
                self._checksums.pop(name, None)
            else:
                self._checksums[name] = checksum
        intact = not self._whole
        if not intact:
            self.version = None
            self._checksums.clear()
        self.begin()
        return intact

    def forget(self) -> None:
        """Hold no base any more (an owned copy frees its memory)."""
        self.version = None
        self._checksums.clear()
        if self.owned:
            self._tensors.clear()
            self._names = []
        self.begin()

    def _alias_written(self, name: str, target: torch.Tensor) -> bool:
        """Whether ``target``'s memory is that of another tensor written in this update."""
        if self.owned:
            return False
        pointer = target.data_ptr()
        return any(n != name and self._tensors[n].data_ptr() == pointer for n in self._written)

    def _checksum(self, name: str) -> int:
        known = self._checksums.get(name)
        if known is None:
            known = self._checksums[name] = bytes_checksum(self._tensors[name])
        return known
