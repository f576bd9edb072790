"""The workers' side of a weight update: what ``WeightUpdates`` calls at each step.

A weight update is vLLM's own transaction in every worker (``start_weight_update``, loads,
``finish_weight_update``) run by this project's transfer engine (``transfer.py``);
``WeightUpdates`` holds the rules (checks before writing, completeness, version) and calls
these steps. Workers lost midway, or replicas left on different weights, break the backend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gen_interface import GenerationError, InFlight, WeightUpdateError
from gen_interface.lifecycle import Lifecycle, LifecycleView
from gen_interface.weights import WeightUpdateSteps

from gen_vllm.receive import LoadInfo
from gen_vllm.refit import MixedWeightsError, verify_update
from gen_vllm.replicas import ReplicaSet, WorkerLostError

__all__ = ["ReplicaUpdateSteps", "failures_break"]

logger = logging.getLogger(__name__)

# Token ids every replica scores after an update: equal logprobs mean equal weights in use.
_PROBE = list(range(3, 35))
_BROKEN = "this VllmGeneration is now broken: shut it down and build a new one"


@contextmanager
def failures_break(lifecycle: Lifecycle | LifecycleView) -> Iterator[None]:
    """A lost worker or a timed-out control call leaves engines in an unknown state."""
    try:
        yield
    except WorkerLostError as exc:
        lifecycle.mark_broken(str(exc))
        raise


class ReplicaUpdateSteps:
    """Begin, load, commit and abort on every replica of ``replicas``.

    Args:
        replicas: the workers.
        lifecycle: the backend's, marked broken when the workers can no longer be trusted.
        vocab_size, context_limit: the model's, for the probe sequence.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        lifecycle: Lifecycle | LifecycleView,
        *,
        vocab_size: int,
        context_limit: int,
    ):
        self.replicas = replicas
        self.lifecycle = lifecycle
        self.probe = [t % vocab_size for t in _PROBE[: max(2, context_limit - 1)]]

    def steps(self, load: Any) -> WeightUpdateSteps:
        """The steps for ``WeightUpdates``, with ``load`` turning handles into a ``LoadInfo``
        load (``self.load``)."""
        return WeightUpdateSteps(begin=self.begin, load=load, commit=self.commit, abort=self.abort)

    def begin(self, version: int, in_flight: InFlight) -> None:
        failed = _errors(self.replicas.start_weight_update(in_flight))
        if failed:
            self._break_if_lost(failed)
            self._close_on_workers()
            raise failed[0]

    def load(self, info: LoadInfo) -> None:
        failed = _errors(self.replicas.load_weights(info))
        if failed:
            self._break_if_lost(failed)
            raise WeightUpdateError(
                f"a weight load failed on {len(failed)} replica(s): {failed[0]}"
            )

    def commit(self, version: int) -> None:
        start = time.perf_counter()
        with failures_break(self.lifecycle):
            try:
                reports = verify_update(self.replicas.finish_weight_update(version))
                if len(self.replicas) > 1:
                    self._check_replicas_agree()
            except MixedWeightsError as exc:
                self.lifecycle.mark_broken(str(exc))
                raise WeightUpdateError(f"{exc}; {_BROKEN}") from exc
        logger.info(
            "committed weight version %d on %d workers in %.2f s",
            version,
            len(reports),
            time.perf_counter() - start,
        )

    def abort(self, written: bool) -> None:
        self._close_on_workers()

    def _close_on_workers(self) -> None:
        """Finish the workers' transactions without a new version (an abort)."""
        if self.lifecycle.state == "broken":
            return  # nothing to save; shutdown frees the workers
        failed = _errors(self.replicas.finish_weight_update(None))
        if failed:
            logger.warning("closing an aborted weight update failed: %s", failed[0])
            self._break_if_lost(failed)

    def _break_if_lost(self, failed: list[GenerationError]) -> None:
        """A worker that died or stopped answering mid-update leaves its engine unknown."""
        lost = [e for e in failed if isinstance(e, WorkerLostError)]
        if lost:
            self.lifecycle.mark_broken(str(lost[0]))
            raise WeightUpdateError(f"{lost[0]}; {_BROKEN}") from lost[0]

    def _check_replicas_agree(self) -> None:
        scores = self.replicas.score([([self.probe], [1])] * len(self.replicas))
        if any(s != scores[0] for s in scores[1:]):
            raise MixedWeightsError(
                "replicas give different logprobs for the same sequence after a weight update; "
                "their weights differ"
            )


def _errors(outcomes: list[Any]) -> list[GenerationError]:
    return [o for o in outcomes if isinstance(o, GenerationError)]
