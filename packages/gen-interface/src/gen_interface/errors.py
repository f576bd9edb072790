"""The error hierarchy every backend raises.

Training code catches these types, never a backend's own: a backend translates its library's
failures (Ray, vLLM, transformers) into one of them, with a message that says what went wrong and
what to do about it.
"""

from __future__ import annotations

__all__ = [
    "BackendBrokenError",
    "BackendUnavailableError",
    "GenerationConfigError",
    "GenerationError",
    "GenerationInputError",
    "MixedWeightsError",
    "NoReplicaServingError",
    "RowLostError",
    "StaleWeightsError",
    "WeightBaseError",
    "WeightUpdateError",
    "WeightsAbsentError",
]


class GenerationError(Exception):
    """Base class of every error raised through the generation interface.

    Raised as is for failures during generation that are not the caller's fault: a worker died,
    an engine stopped answering, generate was called after ``finish_generation``.
    """


class GenerationConfigError(GenerationError, ValueError):
    """A config field is missing or out of range. The message names the field and the range."""


class GenerationInputError(GenerationError, ValueError):
    """A batch given to ``generate`` is malformed. The message names the field, row and value.

    Raised before any worker is touched: the backend stays usable.
    """


class WeightUpdateError(GenerationError):
    """A weight update was refused or did not take. Refused updates leave the old weights."""


class WeightBaseError(WeightUpdateError):
    """A delta names a base the receiver does not hold (another version, other bytes, or none
    at all): refused before anything of it was written. ``Refitter`` then sends the weights
    whole, in the same call."""


class BackendUnavailableError(GenerationError):
    """A backend is not installed, not registered, or cannot run on this machine."""


class BackendBrokenError(GenerationError):
    """The backend can no longer be trusted: a worker or engine died or stopped answering, or
    its replicas hold different weights. Every later call but ``shutdown`` raises
    ``GenerationError`` saying so: shut it down and build a new one."""


class MixedWeightsError(WeightUpdateError, BackendBrokenError):
    """After an update, workers or replicas hold different weights, or some took it and
    others did not: the backend is broken (its rows could come from either)."""


class RowLostError(GenerationError):
    """Rows that had already streamed tokens to the caller were on a replica that died or
    wedged. Their tokens so far stand (nothing delivered is ever taken back), but the rest of
    them cannot be produced elsewhere without contradicting them, so the call ends here.
    Retryable: the backend is usable; run those rows again (the same seed gives the same
    tokens on the same weights). Rows that had streamed nothing were re-run silently.

    Attributes:
        rows: the indices, in the call, of the rows lost.
    """

    retryable = True

    def __init__(self, message: str, rows: tuple[int, ...] = ()):
        super().__init__(message)
        self.rows = rows


class NoReplicaServingError(GenerationError):
    """No replica of the backend's fleet serves now: every one died or wedged, and
    replacements (if any are left to start) are not ready. Nothing is broken for good: retry
    after a while, or shut the backend down and build a new one."""

    retryable = True


class WeightsAbsentError(GenerationError):
    """``generate`` before the backend has real weights: it started without reading its
    checkpoint (``load_format: dummy``) and no weight update has committed yet. Nothing ran; the
    backend is usable, and generates once an update commits."""


class StaleWeightsError(GenerationError):
    """Rows would start on weights more than ``max_weight_staleness`` versions behind the newest
    version announced (``announce_weight_version`` or ``start_weight_update``), and no update in
    progress would close the gap. Nothing ran; the backend is usable: update the weights, then
    call again."""
