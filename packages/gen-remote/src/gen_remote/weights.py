"""``RemoteWeights``: the weight-update methods of the remote backend, on the server's routes.

The transaction is the server's backend's: ``start_weight_update`` is ``/start_weight_update``,
each load is one ``/update_weights`` (shared-memory handles when the server runs on this machine,
or a collective bucket the trainer broadcasts meanwhile), ``commit_weight_update`` is
``/finish_weight_update`` and ``abort_weight_update`` ``/abort_weight_update``. The server checks
every load against its model and every checksum, so a ``Refitter`` or ``WeightBroadcaster``
drives this client exactly as it drives a local backend. The client only checks what it can
without the model (versions, handles) and times the phases for its metrics.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from gen_backend_kit.weights.consumer import release_shared_weights
from gen_backend_kit.weights.loads_in_flight import LoadsInFlight
from gen_backend_kit.weights.transaction import next_version
from gen_interface import InFlight, WeightUpdateError
from gen_interface.weights import LoadSize, WeightBase, describe_weight_handles, handles_to_json
from gen_interface.weights.handles import dtype_name

if TYPE_CHECKING:
    from gen_backend_kit.lifecycle import Lifecycle, LifecycleView
    from gen_backend_kit.metrics import GenerationMetrics

    from gen_remote.server import ServerInfo
    from gen_remote.wire import Wire

__all__ = ["RemoteWeights"]


@dataclass
class _OpenUpdate:
    """An update this client opened: when, and how long its phases took."""

    started: float = field(default_factory=time.perf_counter)
    begin_seconds: float = 0.0
    loads: LoadsInFlight = field(default_factory=LoadsInFlight)  # a Refitter runs several
    size: LoadSize = field(default_factory=LoadSize)  # what the loads carried


class RemoteWeights:
    """Weight updates, versions and the staleness announcements, forwarded to the server."""

    _wire: Wire
    server: ServerInfo
    if TYPE_CHECKING:  # GenerationBackend's, which RemoteGeneration also derives from

        @property
        def lifecycle(self) -> Lifecycle | LifecycleView: ...

        @property
        def metrics(self) -> GenerationMetrics: ...

    _announced: int
    _open_update: _OpenUpdate | None = None

    @property
    def weight_version(self) -> int:
        if self.server.dialect != "gen-serve":
            return 0
        route = "/weight_info" if self.server.weight_routes else "/backend_info"
        return int(self._wire.call("GET", route)["weight_version"])

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        self._require_weight_routes("start_weight_update")
        if version is not None:
            next_version(0, version)  # an integer >= 0, or WeightUpdateError
        opened = _OpenUpdate()
        self.lifecycle.begin_update()
        try:
            answer = self._wire.call(
                "POST", "/start_weight_update", {"version": version, "in_flight": in_flight}
            )
        except BaseException:
            self.lifecycle.end_update()
            raise
        target = int(answer["weight_version"])
        opened.begin_seconds = time.perf_counter() - opened.started
        self._open_update = opened
        self._announced = max(self._announced, target)
        return target

    def announce_weight_version(self, version: int) -> None:
        self._require_weight_routes("announce_weight_version")
        next_version(0, version)
        self._wire.call("POST", "/announce_weight_version", {"version": version})
        self._announced = max(self._announced, version)

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        try:
            self._require_weight_routes("update_weights_from_ipc_handles")
            describe_weight_handles(handles)
            size = LoadSize()
            for bucket in handles["buckets"]:
                size += LoadSize.of_slots(bucket["tensors"])
            self._load({"handles": handles_to_json(handles)}, size)
        finally:
            release_shared_weights(handles)  # the server released them once read; idempotent

    def update_weights_from_collective(self, bucket: Mapping[str, Any]) -> None:
        self._require_weight_routes("update_weights_from_collective", "collective")
        self._load({"broadcast": dict(bucket)}, LoadSize.of_slots(bucket["tensors"]))

    def weight_base(self) -> WeightBase | None:
        """The server's backend's base for deltas (``/weight_base``); None from a server that
        has no such route (vLLM's own, or one without weight routes)."""
        if self.server.dialect != "gen-serve" or not self.server.weight_deltas:
            return None
        self.lifecycle.check_open(WeightUpdateError)
        base = self._wire.call("GET", "/weight_base")["weight_base"]
        if base is None:
            return None
        version = base["version"]
        return WeightBase(
            version=None if version is None else int(version),
            checksum=int(base["checksum"]),
            dtypes={str(name): str(dtype) for name, dtype in base["dtypes"].items()},
        )

    def collective_ranks(self) -> int:
        self._require_weight_routes("collective_ranks", "collective")
        return int(self._wire.call("GET", "/get_world_size")["world_size"])

    def collective_intact(self) -> bool:
        """The server's answer (gen-serve's ``/get_world_size``); True from a server that does
        not say (vLLM's own: its workers never change)."""
        self._require_weight_routes("collective_intact", "collective")
        answer = self._wire.call("GET", "/get_world_size")
        return bool(answer.get("weight_group_intact", True))

    def init_collective(self, endpoint: Mapping[str, Any]) -> None:
        self._require_weight_routes("init_collective", "collective")
        self._wire.call("POST", "/init_weight_transfer_engine", {"init_info": dict(endpoint)})

    def commit_weight_update(self, version: int | None = None) -> int:
        self._require_weight_routes("commit_weight_update")
        if version is not None:
            next_version(0, version)
        committing = time.perf_counter()
        opened, self._open_update = self._open_update, None
        try:
            answer = self._wire.call("POST", "/finish_weight_update", {"weight_version": version})
        finally:
            if opened is not None:
                self.lifecycle.end_update()
        committed = int(answer["weight_version"])
        self._announced = max(self._announced, committed)
        if opened is not None:
            done = time.perf_counter()
            self.metrics.refit_committed(
                done - opened.started,
                {
                    "begin": opened.begin_seconds,
                    "load": opened.loads.seconds,
                    "commit": done - committing,
                },
                opened.size.whole_bytes,
                opened.size,
            )
        self.metrics.set_weight_version(committed)
        self.lifecycle.weights_arrived()
        return committed

    def abort_weight_update(self) -> None:
        self._require_weight_routes("abort_weight_update")
        opened, self._open_update = self._open_update, None
        try:
            self._wire.call("POST", "/abort_weight_update")
        finally:
            if opened is not None:
                self.lifecycle.end_update()

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        self._require_weight_routes("prepare_refit_info")
        info = {
            name: [list(shape), dtype_name(dtype)]
            for name, (shape, dtype) in state_dict_info.items()
        }
        self._wire.call("POST", "/prepare_refit_info", {"state_dict_info": info})

    # ---- helpers -------------------------------------------------------------------------

    def _load(self, update_info: dict[str, Any], size: LoadSize) -> None:
        """One ``/update_weights``: a load of the open update, or an update of its own."""
        opened = self._open_update
        loads = opened.loads if opened is not None else LoadsInFlight()
        loads.started()
        try:
            with self.lifecycle.updating_weights():
                self._wire.call("POST", "/update_weights", {"update_info": update_info})
        finally:
            loads.finished()
        if opened is not None:
            opened.size += size
            return
        seconds = loads.seconds
        version = self.weight_version  # the server committed it as an update of its own
        self._announced = max(self._announced, version)
        self.metrics.refit_committed(seconds, {"load": seconds}, size.whole_bytes, size)
        self.metrics.set_weight_version(version)
        self.lifecycle.weights_arrived()

    def _require_weight_routes(self, method: str, transport: str | None = None) -> None:
        """Refuse ``method`` unless the server takes weight updates (by ``transport``)."""
        why = None
        if self.server.dialect != "gen-serve":
            why = "vLLM's own server is driven for generation and scoring only"
        elif not self.server.weight_routes:
            why = "the server was started with --no-weight-routes"
        elif transport is not None and transport not in self.server.capabilities.get(
            "weight_transports", ()
        ):
            why = f"the server's backend ({self.server.backend}) has no {transport} path"
        if why is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support {method}: {why}")
        self.lifecycle.check_open(WeightUpdateError)
