"""The collective path: weights broadcast from a trainer to generation workers on other machines.

A process group of its own joins the trainer (rank 0) and every generation worker (ranks 1..n),
built from a ``TCPStore`` rendezvous, independent of any group the trainer already has (the
default ``torch.distributed`` group is never touched): gloo for CPU tensors, NCCL for CUDA ones.
Weights travel in buckets: the trainer packs one, tells the backend what it holds (names, dtypes,
shapes, offsets, checksum), and broadcasts it; every worker receives, verifies and loads it, in
the same transaction as the shared-memory path (the receiving end is the backend kit's
``gen_backend_kit.weights.receive_broadcast``).

A backend whose workers change (a healing fleet replaced a lost replica) breaks the group: its
ranks are fixed when it forms. The broadcaster forms it again with the backend's workers of now
before a refit when their number changed or the backend says a member was replaced
(``collective_intact``), and once more when a broadcast fails because a member is gone (the
failed attempt is aborted first, so the weights in force do not change); then it sends the refit
again.

Trainer::

    broadcaster = WeightBroadcaster.connect(generator)      # once
    broadcaster.refit(model.state_dict(), version=step)    # after every training step
    broadcaster.close()
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import combine_checksums
from gen_interface.weights.handles import LoadSize, TensorSlot
from gen_interface.weights.layout import Entry, group_bytes, iter_buckets, pack
from gen_interface.weights.producer import named_tensors
from gen_interface.weights.sent import SentWeights

if TYPE_CHECKING:
    from gen_interface.interface import GenerationInterface, InFlight

__all__ = [
    "BroadcastBucket",
    "CollectiveEndpoint",
    "WeightBroadcaster",
    "broadcast",
    "join_weight_group",
]

#: Bytes per broadcast: large enough to amortise each call's latency.
DEFAULT_BROADCAST_BYTES = 256 * 2**20


class CollectiveEndpoint(TypedDict):
    """Where the group meets and who is in it (plain data, sent to the backend)."""

    host: str  # the trainer's address, reachable from every worker
    port: int  # the rendezvous port (a TCPStore the trainer serves)
    world_size: int  # 1 + the backend's collective_ranks()
    rank_offset: int  # rank of the backend's first worker (1: right after the trainer)
    timeout_s: float  # how long a rendezvous or one broadcast may take


class BroadcastBucket(TypedDict):
    """What one broadcast holds, sent to the backend ahead of the bytes."""

    tensors: list[TensorSlot]  # each with its checksum, taken on the trainer's device
    nbytes: int
    checksum: int  # combine_checksums of the tensors' checksums


@dataclass
class WeightGroup:
    """A joined process group and this process's place in it."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    device: torch.device


def join_weight_group(endpoint: CollectiveEndpoint, rank: int, device: torch.device) -> WeightGroup:
    """Join the weight group as ``rank``; blocks until every rank has joined.

    Rank 0 serves the rendezvous. CUDA devices use NCCL, CPU uses gloo.

    Raises:
        WeightUpdateError: the group could not form within the endpoint's timeout.
    """
    from torch.distributed import ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=endpoint["timeout_s"])
    try:
        store = TCPStore(
            endpoint["host"], endpoint["port"], endpoint["world_size"], rank == 0, timeout=timeout
        )
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            nccl: Any = ProcessGroupNCCL  # its stub lists only the Options overload
            group: Any = nccl(store, rank, endpoint["world_size"], timeout)
        else:
            group = ProcessGroupGloo(store, rank, endpoint["world_size"], timeout)
    except Exception as exc:
        raise WeightUpdateError(
            f"could not join the weight group at {endpoint['host']}:{endpoint['port']} as rank "
            f"{rank} of {endpoint['world_size']}: {exc}"
        ) from exc
    return WeightGroup(group, rank, device)


def broadcast(group: WeightGroup, data: torch.Tensor) -> None:
    """Broadcast ``data`` from rank 0 to every rank (in place on receivers)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.group.broadcast([data], options).wait()


class WeightBroadcaster:
    """The trainer's end of the collective path to one backend.

    Build it with ``connect``; it holds the group until ``close``. With ``deltas`` (the
    default), a backend that keeps a base (``weight_base()``) gets each tensor whole or as a
    delta against the version it holds, whichever is smaller, and this broadcaster keeps a copy
    of the weights it last sent (``SentWeights``: one copy of the model in the backend's
    dtypes, in this process). Deltas are taken of host tensors only.
    """

    def __init__(
        self,
        backend: GenerationInterface,
        group: WeightGroup,
        *,
        deltas: bool = True,
        rejoin: Callable[[], WeightGroup] | None = None,
    ):
        """``rejoin`` forms the group again with the backend's workers of now (``connect``
        gives one); without it a changed backend's refit fails."""
        self.backend = backend
        self.group = group
        self.deltas = deltas
        self._sent = SentWeights()
        self._rejoin = rejoin
        self._closed = False
        #: What the last refit carried (tensors, deltas, whole and sent bytes); None before one.
        self.last_size: LoadSize | None = None
        #: Times the group was formed again because the backend's workers changed.
        self.rejoins = 0

    @classmethod
    def connect(
        cls,
        backend: GenerationInterface,
        *,
        device: torch.device | str = "cpu",
        host: str | None = None,
        port: int = 0,
        timeout_s: float = 300.0,
        deltas: bool = True,
    ) -> WeightBroadcaster:
        """Form the group: the backend's workers join while this process serves as rank 0.

        Args:
            backend: a backend whose capabilities list ``"collective"``.
            device: where the trainer's weights are sent from: ``"cpu"`` (gloo) or a CUDA
                device (NCCL; the workers must be on GPUs too).
            host: this machine's address as the workers reach it; default: its host name's.
            port: the rendezvous port; 0 picks a free one (as every later forming does).
            timeout_s: how long forming the group and each broadcast may take.
            deltas: send deltas where the backend takes them (see the class).
        """
        address = host or socket.gethostbyname(socket.gethostname())
        ports = [port] if port else []

        def form() -> WeightGroup:
            endpoint = CollectiveEndpoint(
                host=address,
                port=ports.pop() if ports else _free_port(),
                world_size=1 + backend.collective_ranks(),
                rank_offset=1,
                timeout_s=timeout_s,
            )
            joined = _Background(backend.init_collective, endpoint)
            try:
                group = join_weight_group(endpoint, 0, torch.device(device))
            finally:
                joined.result()
            return group

        return cls(backend, form(), deltas=deltas, rejoin=form)

    def refit(
        self,
        state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        in_flight: InFlight = "keep",
        bucket_bytes: int = DEFAULT_BROADCAST_BYTES,
    ) -> int:
        """Broadcast ``state_dict`` to every worker as one transaction; returns the version.
        ``in_flight``: what happens to rows running meanwhile (``start_weight_update``). With
        deltas, each bucket's deltas are taken while the bucket before it loads.

        Raises:
            WeightUpdateError: the backend refused or failed the update (it was aborted), the
                group could not be formed again, or this broadcaster is closed.
        """
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, entry in named_tensors(state_dict):
            if not isinstance(entry, torch.Tensor):
                raise ValueError(f"{name!r}: a refit takes tensors and makes any deltas itself")
            tensors.append((name, entry))

        def run(entries: Iterable[tuple[str, Entry]]) -> int:
            return self._send(entries, version, in_flight, bucket_bytes)

        def attempt() -> int:
            if self.deltas and self.group.device.type == "cpu":
                return self._sent.send(self.backend, tensors, run)
            return run(tensors)

        if self._closed:
            raise WeightUpdateError("this WeightBroadcaster is closed: connect a new one")
        if self._rejoin is not None and not self._group_current():
            self._form_again()
        try:
            return attempt()
        except _GroupBrokenError:
            if self._rejoin is None:
                raise
            self._form_again()
            return attempt()

    def _group_current(self) -> bool:
        """The group holds exactly the backend's workers of now (their number, and the backend
        says none was replaced since it formed)."""
        if 1 + self.backend.collective_ranks() != self._size():
            return False
        return self.backend.collective_intact()

    def _size(self) -> int:
        """Ranks in the group; 0 once it is left (a forming that failed leaves none)."""
        group = self.group.group
        return int(group.size()) if group is not None else 0

    def _form_again(self) -> None:
        """The backend's workers changed: leave the old group and form one with them."""
        assert self._rejoin is not None
        self.group.group = None
        self.group = self._rejoin()
        self.rejoins += 1

    def _send(
        self,
        entries: Iterable[tuple[str, Entry]],
        version: int | None,
        in_flight: InFlight,
        bucket_bytes: int,
    ) -> int:
        """One transaction: every bucket of ``entries`` packed, announced and broadcast."""
        self.backend.start_weight_update(version, in_flight=in_flight)
        loading: _Background | None = None
        size = LoadSize()
        try:
            for group in iter_buckets(entries, bucket_bytes):
                device = self.group.device
                data = torch.empty(max(group_bytes(group), 1), dtype=torch.uint8, device=device)
                slots, used = pack(data, group)
                bucket = BroadcastBucket(
                    tensors=slots,
                    nbytes=used,
                    checksum=combine_checksums(slot["checksum"] for slot in slots),
                )
                size += LoadSize.of_slots(slots)
                if loading is not None:
                    loading.result()  # one load at a time; packing overlapped with it
                loading = _Background(self.backend.update_weights_from_collective, bucket)
                try:
                    broadcast(self.group, data)
                except RuntimeError as exc:  # gloo and NCCL raise this when a peer is gone
                    raise _GroupBrokenError(
                        f"a broadcast to the backend's workers failed ({exc}): a worker of "
                        "the weight group is gone; the update was aborted"
                    ) from exc
            if loading is not None:
                loading.result()
            committed = self.backend.commit_weight_update()
            self.last_size = size
            return committed
        except BaseException:
            if loading is not None:
                loading.wait()
            self.backend.abort_weight_update()
            raise

    def sent_bytes(self) -> int:
        """Bytes of the copy of the last weights sent, kept for deltas (0 without deltas)."""
        return self._sent.nbytes

    def close(self) -> None:
        """Leave the group (the backend's workers leave at their shutdown) and free the copy
        kept for deltas."""
        self.group.group = None
        self._closed = True
        self._sent.forget()


class _GroupBrokenError(WeightUpdateError):
    """A broadcast failed because a member of the group is gone (the update is aborted)."""


class _Background:
    """A call run on a thread, whose result (or exception) is collected later."""

    def __init__(self, call: Any, *args: Any):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call, *args), daemon=True)
        self._thread.start()

    def _run(self, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except BaseException as exc:
            self._error = exc

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])
