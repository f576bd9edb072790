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


class WeightsAbsentError(GenerationError):
    """``generate`` before the backend has real weights: it started without reading its
    checkpoint (``load_format: dummy``) and no weight update has committed yet. Nothing ran; the
    backend is usable, and generates once an update commits."""


class StaleWeightsError(GenerationError):
    """Rows would start on weights more than ``max_weight_staleness`` versions behind the newest
    version announced (``announce_weight_version`` or ``start_weight_update``), and no update in
    progress would close the gap. Nothing ran; the backend is usable: update the weights, then
    call again."""
