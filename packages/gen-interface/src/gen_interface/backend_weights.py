"""``WeightUpdateMethods``: the weight-update half of ``GenerationBackend``.

The public methods of a weight-update transaction (``start_weight_update``, the three kinds of
load, ``commit_weight_update``, ``abort_weight_update``, ``prepare_refit_info``) run the shared
``WeightUpdates`` rules around the backend's own steps, whose defaults are here too: a backend
overrides ``_load_handles`` (and optionally ``_write_state_dict``, ``_load_broadcast``) and the
``_begin_update`` / ``_commit_update`` / ``_abort_update`` around them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.interface import InFlight
from gen_interface.lifecycle import Lifecycle, LifecycleView
from gen_interface.weights.consumer import (
    check_update_is_complete,
    check_weights_match,
    release_shared_weights,
    state_dict_specs,
)
from gen_interface.weights.handles import describe_slots
from gen_interface.weights.updates import LoadWait, WeightUpdates

__all__ = ["WeightUpdateMethods"]


class WeightUpdateMethods:
    """Weight updates of a ``GenerationBackend``, which sets ``_weights`` (None: the backend
    takes no updates) and ``_lifecycle``."""

    _weights: WeightUpdates | None
    _lifecycle: Lifecycle | LifecycleView

    if TYPE_CHECKING:

        def _implements(self, step: str) -> bool: ...

    @property
    def weight_version(self) -> int:
        return self._weights.version if self._weights is not None else 0

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        weights = self._weight_updates("start_weight_update")
        with self._lifecycle.breaks_on_fatal():
            return weights.start(version, in_flight)

    def announce_weight_version(self, version: int) -> None:
        self._weight_updates("announce_weight_version").announce(version)

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        weights = self._weight_updates("update_weights_from_ipc_handles")
        try:
            with self._lifecycle.breaks_on_fatal():
                weights.load(handles)
        finally:
            release_shared_weights(handles)

    def update_weights_from_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        weights = self._weight_updates("update_weights_from_state_dict", "_write_state_dict")
        with self._lifecycle.breaks_on_fatal():
            weights.load_described(
                state_dict_specs(state_dict), lambda: self._write_state_dict(state_dict)
            )

    def update_weights_from_collective(self, bucket: Mapping[str, Any]) -> None:
        weights = self._weight_updates("update_weights_from_collective", "_load_broadcast")
        with self._lifecycle.breaks_on_fatal():
            weights.load_described(
                describe_slots(bucket["tensors"]), lambda: self._load_broadcast(bucket)
            )

    def commit_weight_update(self, version: int | None = None) -> int:
        weights = self._weight_updates("commit_weight_update")
        with self._lifecycle.breaks_on_fatal():
            return weights.commit(version)

    def abort_weight_update(self) -> None:
        weights = self._weight_updates("abort_weight_update")
        with self._lifecycle.breaks_on_fatal():
            weights.abort()

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        """Check that updates described by ``state_dict_info`` fit the model: every name known,
        shapes equal, dtypes castable, and every weight of the model present."""
        weights = self._weight_updates("prepare_refit_info")
        check_weights_match(state_dict_info, weights.model)
        check_update_is_complete(state_dict_info, weights.model, weights.optional)

    def _weight_updates(self, method: str, step: str = "_load_handles") -> WeightUpdates:
        """The transaction state, once the backend is known to take updates this way."""
        if self._weights is None or not self._implements(step):
            raise NotImplementedError(f"{type(self).__name__} does not support {method}")
        self._lifecycle.check_open(WeightUpdateError)
        return self._weights

    # ---- the backend's steps -------------------------------------------------------------

    def _load_handles(self, handles: Mapping[str, Any]) -> LoadWait | None:
        """Write one load of shared weights (already checked against the model) everywhere,
        or queue it on workers that run loads in order and return its wait (see
        ``WeightUpdateSteps.load``)."""
        raise NotImplementedError(f"{type(self).__name__} does not support weight updates")

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write one load from an in-process state dict (already checked)."""
        raise NotImplementedError

    def _load_broadcast(self, bucket: Mapping[str, Any]) -> None:
        """Receive one broadcast bucket on every worker and write it (already checked)."""
        raise NotImplementedError

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        """Prepare for loads: running rows pause (``"keep"``) or end cut short (``"abort"``)."""

    def _commit_update(self, version: int) -> None:
        """Every weight arrived: verify, label the weights ``version``, let paused rows go on."""

    def _abort_update(self, written: bool) -> None:
        """The update is dropped. ``written``: some loads were written, so rows paused by
        ``_begin_update`` must not go on (their next tokens would come from part-old, part-new
        weights): end them cut short. Otherwise they resume as if nothing happened."""
