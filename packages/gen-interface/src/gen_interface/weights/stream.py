"""Streaming refit, producer side: the trainer's tensors flow through a few reusable buckets.

``Refitter(backend).refit(state_dict)`` opens a weight-update transaction on the backend, then
fills one bucket while the backend loads the previous one (double buffering), and commits. The
extra memory is ``buffers`` buckets per place, whatever the model size, kept from one refit to the
next. A trainer needs only this package.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

import torch

from gen_interface.interface import BackendCapabilities
from gen_interface.weights.collective import WeightBroadcaster
from gen_interface.weights.handles import LoadSize, WeightHandles
from gen_interface.weights.in_place import in_place_handles, split_in_place
from gen_interface.weights.layout import (
    Allocation,
    Entry,
    NamedEntries,
    NamedTensors,
    Place,
    fill_bucket,
    group_bytes,
    iter_buckets,
    local_handles,
    resolve_places,
)
from gen_interface.weights.producer import named_tensors
from gen_interface.weights.sent import SentWeights
from gen_interface.weights.shm import unlink_segment

if TYPE_CHECKING:
    from gen_interface.interface import GenerationInterface, InFlight

__all__ = ["DEFAULT_STREAM_BUCKET_BYTES", "BucketRing", "Refitter", "refit"]

logger = logging.getLogger(__name__)

#: Bucket size of a streaming refit into a backend that states no other
#: (``BackendCapabilities.refit_bucket_bytes``): big enough that per-bucket calls cost little.
DEFAULT_STREAM_BUCKET_BYTES = BackendCapabilities.refit_bucket_bytes


class BucketRing:
    """``count`` reusable buckets in each place, filled in turn.

    Args:
        places: where copies go (host memory, or each GPU a worker reads from).
        capacity: bytes per bucket; a group larger than that gets its slot grown to fit.
        count: buckets per place; 2 lets one be filled while a backend reads the other.
    """

    def __init__(self, places: Sequence[Place], capacity: int, count: int = 2):
        if count < 1 or capacity < 1:
            raise ValueError(f"count and capacity must be >= 1, got {count}, {capacity}")
        self.places = list(places)
        self.capacity = capacity
        self._slots: list[list[Allocation | None]] = [[None] * count for _ in self.places]
        # Collected or at interpreter exit, the segments go with the ring.
        weakref.finalize(self, _free_slots, self._slots)

    @property
    def count(self) -> int:
        return len(self._slots[0])

    def fill(self, slot: int, group: Sequence[tuple[str, Entry]]) -> WeightHandles:
        """Copy ``group`` into bucket ``slot`` of every place; handles for just those buckets.

        The caller must know that no consumer still reads that slot's previous contents.
        """
        needed = max(group_bytes(group), 1)
        buckets = []
        for place, allocations in zip(self.places, self._slots, strict=True):
            current = allocations[slot]
            if current is None or current.capacity < needed:
                if current is not None:
                    _free(current)
                allocations[slot] = current = place.allocate(max(self.capacity, needed))
            buckets.append(fill_bucket(current, group))
        return local_handles(buckets, release_after_read=False)

    def allocated_bytes(self) -> int:
        """Bytes the ring holds now, all places and slots."""
        return sum(a.capacity for slots in self._slots for a in slots if a is not None)

    def close(self) -> None:
        """Unlink every segment and drop every CUDA bucket. Idempotent."""
        _free_slots(self._slots)

    def __enter__(self) -> BucketRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Refitter:
    """A trainer's streamed refits into one backend, keeping its buckets from one refit to the
    next (new buckets would be faulted in anew by the trainer and by every worker, each time).

    A backend in this process (``capabilities.shares_process``: gen-hf) gets the tensors
    themselves in one ``update_weights_from_state_dict`` of the transaction: no bucket, and no
    copy but its own into the model. Host tensors that already live in this project's shared
    memory (``share_parameters``) are sent in place, with no copy and no bucket. A backend that
    shared memory cannot reach (a
    ``remote`` one on another machine: ``"collective"`` among its transports, neither ``"shm"``
    nor ``"cuda_ipc"``) gets its refits broadcast instead, through a ``WeightBroadcaster`` made
    on the first refit.

    **Deltas.** With ``deltas`` on, a backend that keeps a base (``weight_base()``) gets each
    tensor whole or as a delta against the version it holds, whichever is smaller
    (``gen_interface.weights.delta``); this refitter then keeps a copy of the weights it last
    sent, in the backend's dtypes (``SentWeights``: one copy of the model, in this process).
    A backend without a base, or one whose base is not what was last sent here (a new replica,
    a restarted server, another version), gets every tensor whole, in the same call. Host
    tensors only: tensors on a GPU go whole.

    Args:
        backend: any backend with weight-update transactions.
        bucket_bytes: bytes per bucket; default: what the backend states it loads fastest
            (``capabilities.refit_bucket_bytes``).
        devices: GPUs to place a copy on, one per generation GPU (see ``share_weights``);
            default: the weights' own device.
        buffers: buckets per place (2: double buffering); default: the backend's
            ``capabilities.refit_buffers``.
        collective_host: this machine's address as the backend reaches it, when refits are
            broadcast (``WeightBroadcaster.connect``'s ``host``).
        hand_over: give the backend the tensors themselves; default: when it shares this
            process. False streams through buckets anyway. ``bucket_bytes``, ``devices`` and
            ``buffers`` shape buckets only.
        deltas: send deltas where the backend takes them; default: on the collective path
            (across machines, where bytes cost most: ``tools/bench/delta_refit.py``), off
            through shared memory on one machine and for a hand-over, where they were measured
            to save nothing.

    Raises:
        ValueError: ``hand_over=True`` for a backend that takes no in-process state dict, or
            ``deltas=True`` with a hand-over (which sends no bytes).
    """

    def __init__(
        self,
        backend: GenerationInterface,
        *,
        bucket_bytes: int | None = None,
        devices: Sequence[torch.device | int | str] | None = None,
        buffers: int | None = None,
        collective_host: str | None = None,
        hand_over: bool | None = None,
        deltas: bool | None = None,
    ):
        capabilities = backend.capabilities
        transports = capabilities.weight_transports
        if hand_over and "state_dict" not in transports:
            raise ValueError(
                f"hand_over=True, but {type(backend).__name__} takes no in-process state dict "
                "(capabilities.weight_transports has no 'state_dict'): leave hand_over unset"
            )
        self.hands_over = (
            capabilities.shares_process and "state_dict" in transports
            if hand_over is None
            else hand_over
        )
        self.broadcasts = "collective" in transports and not transports & {"shm", "cuda_ipc"}
        if deltas and self.hands_over:
            raise ValueError(
                f"deltas=True, but {type(backend).__name__} is handed the tensors themselves "
                "(no bytes to save): pass hand_over=False to stream deltas through buckets"
            )
        self.deltas = self.broadcasts if deltas is None else deltas
        self.collective_host = collective_host
        self._broadcaster: WeightBroadcaster | None = None
        self.backend = backend
        self.bucket_bytes = (
            capabilities.refit_bucket_bytes if bucket_bytes is None else bucket_bytes
        )
        self.devices = devices
        self.buffers = capabilities.refit_buffers if buffers is None else buffers
        self._ring: BucketRing | None = None
        self._sent = SentWeights()
        #: What the last refit carried (tensors, deltas, whole and sent bytes); None before one.
        self.last_size: LoadSize | None = None

    def refit(
        self,
        state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        in_flight: InFlight = "keep",
    ) -> int:
        """Load ``state_dict`` into the backend as one verified transaction, streamed.

        ``start_weight_update(version)``, then one ``update_weights_from_ipc_handles`` per bucket
        while the next bucket is filled (as many loads in flight as buckets: the calls run on
        that many threads), then ``commit_weight_update()``; for a backend in this
        process, one ``update_weights_from_state_dict`` instead of the buckets. If anything fails
        the transaction is aborted (``abort_weight_update``) and the error raised. Tensors in
        ``share_parameters`` segments, and every tensor handed over, are read where they are:
        the trainer must not write to them until this returns. With deltas (see the class),
        each bucket's deltas are taken while the bucket before it loads.

        Args:
            state_dict: every weight of the model, ``{name: tensor}`` or pairs, on one device.
            version: the weight version to commit; default: the backend's current one plus one.
            in_flight: what happens to rows running meanwhile (``start_weight_update``).

        Returns:
            The committed weight version.

        Raises:
            WeightUpdateError: the backend refused or failed the update (it was aborted).
            ValueError: a name repeats or the tensors sit on several devices without
                ``devices``.
        """
        tensors = _tensors(named_tensors(state_dict))
        if self.hands_over:
            return self._hand_over(tensors, version, in_flight)
        if self.broadcasts:
            return self._broadcast(tensors, version, in_flight)
        places = resolve_places(tensors, self.devices)
        if self.deltas and places == [Place(None)]:

            def stream(entries: Iterable[tuple[str, Entry]]) -> int:
                return self._stream(entries, places, version, in_flight)

            return self._sent.send(self.backend, tensors, stream)
        self._sent.forget()
        return self._stream(tensors, places, version, in_flight)

    def _stream(
        self,
        entries: Iterable[tuple[str, Entry]],
        places: list[Place],
        version: int | None,
        in_flight: InFlight,
    ) -> int:
        """One transaction of ``entries`` through the ring (tensors in ``share_parameters``
        segments, when ``entries`` is a list of host tensors, in place)."""
        in_place: list[tuple[Allocation, NamedTensors]] = []
        if isinstance(entries, list) and places == [Place(None)]:
            in_place, rest = split_in_place(cast(NamedTensors, entries))
            entries = rest
        backend = self.backend
        size = LoadSize()
        # A load per bucket may be in flight: a backend that queues loads (gen-vllm) starts
        # each one as the one before ends, with no call in between.
        with (
            ThreadPoolExecutor(max(1, self.buffers)) as loader,
            _transaction(backend, version, in_flight),
        ):
            loading: list[Future[None]] = []  # every load, in order
            filled: list[Future[None]] = []  # loads of ring buckets, in order
            try:
                for segment, group in in_place:
                    handles = in_place_handles(segment, group)
                    size += _size_of(handles)
                    loading.append(loader.submit(backend.update_weights_from_ipc_handles, handles))
                for index, bucket in enumerate(iter_buckets(entries, self.bucket_bytes)):
                    ring = self._ring_for(places)
                    if len(filled) >= ring.count:  # the slot to fill is still being read
                        filled.pop(0).result()
                    handles = ring.fill(index % ring.count, bucket)
                    size += _size_of(handles)
                    filled.append(loader.submit(backend.update_weights_from_ipc_handles, handles))
                    loading.append(filled[-1])
                for future in loading:
                    future.result()
                committed = backend.commit_weight_update()
                self.last_size = size
                return committed
            except BaseException:
                for future in loading:  # loads not started are dropped; a running one finishes
                    if not future.cancel():
                        with contextlib.suppress(Exception):
                            future.exception()
                raise  # the transaction is aborted once no load runs

    def _ring_for(self, places: list[Place]) -> BucketRing:
        if self._ring is None or self._ring.places != places:
            if self._ring is not None:
                self._ring.close()
            self._ring = BucketRing(places, self.bucket_bytes, self.buffers)
        return self._ring

    def _hand_over(self, tensors: NamedTensors, version: int | None, in_flight: InFlight) -> int:
        """The refit of a backend in this process: the tensors themselves, in one load."""
        with _transaction(self.backend, version, in_flight):
            self.backend.update_weights_from_state_dict(dict(tensors))
            committed = self.backend.commit_weight_update()
            whole = sum(t.numel() * t.element_size() for _, t in tensors)
            self.last_size = LoadSize(len(tensors), 0, whole, whole)
            return committed

    def _broadcast(self, tensors: NamedTensors, version: int | None, in_flight: InFlight) -> int:
        """The refit through the collective path: the group is formed on the first refit."""
        if self._broadcaster is None:
            device = tensors[0][1].device if tensors else torch.device("cpu")
            self._broadcaster = WeightBroadcaster.connect(
                self.backend, device=device, host=self.collective_host, deltas=self.deltas
            )
        committed = self._broadcaster.refit(
            tensors, version=version, in_flight=in_flight, bucket_bytes=self.bucket_bytes
        )
        self.last_size = self._broadcaster.last_size
        return committed

    def sent_bytes(self) -> int:
        """Bytes of the copy of the last weights sent, kept for deltas (0 without deltas)."""
        held = self._sent.nbytes
        if self._broadcaster is not None:
            held += self._broadcaster.sent_bytes()
        return held

    def allocated_bytes(self) -> int:
        """Bytes of the buckets held now (0 before the first copy, and after ``close``)."""
        return 0 if self._ring is None else self._ring.allocated_bytes()

    def close(self) -> None:
        """Free the buckets and the copy kept for deltas (and leave the weight group).
        Idempotent; a later ``refit`` makes new ones, and sends every tensor whole."""
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._sent.forget()

    def __enter__(self) -> Refitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refit(
    backend: GenerationInterface,
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    version: int | None = None,
    in_flight: InFlight = "keep",
    bucket_bytes: int | None = None,
    devices: Sequence[torch.device | int | str] | None = None,
    buffers: int | None = None,
    hand_over: bool | None = None,
) -> int:
    """One streamed refit with buckets of its own (see ``Refitter.refit``); a training loop that
    refits every step keeps a ``Refitter`` instead, so its buckets are reused."""
    with Refitter(
        backend,
        bucket_bytes=bucket_bytes,
        devices=devices,
        buffers=buffers,
        hand_over=hand_over,
        deltas=False,  # one refit has no last one to take deltas against
    ) as once:
        return once.refit(state_dict, version=version, in_flight=in_flight)


@contextlib.contextmanager
def _transaction(
    backend: GenerationInterface, version: int | None, in_flight: InFlight
) -> Iterator[None]:
    """Open a weight update on ``backend``; abort it if the body raises (keeping that error).
    The body commits."""
    backend.start_weight_update(version, in_flight=in_flight)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # keep the original error
            backend.abort_weight_update()
        raise


def _tensors(entries: NamedEntries) -> NamedTensors:
    """The tensors of a state dict given to a refit (deltas are the refit's to make)."""
    for name, entry in entries:
        if not isinstance(entry, torch.Tensor):
            raise ValueError(
                f"{name!r} is a {type(entry).__name__}: a refit takes the tensors themselves "
                "and makes any deltas (share_weights sends ready-made ones)"
            )
    return cast(NamedTensors, entries)


def _size_of(handles: WeightHandles) -> LoadSize:
    size = LoadSize()
    for bucket in handles["buckets"]:
        size += LoadSize.of_slots(bucket["tensors"])
    return size


def _free(allocation: Allocation) -> None:
    if allocation.path:
        unlink_segment(allocation.path)


def _free_slots(slots: list[list[Allocation | None]]) -> None:
    for allocations in slots:
        for i, allocation in enumerate(allocations):
            if allocation is not None:
                _free(allocation)
                allocations[i] = None
