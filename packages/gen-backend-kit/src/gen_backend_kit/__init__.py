"""gen-backend-kit: what a generation backend is built on.

A backend subclasses ``GenerationBackend`` (or ``InProcessBackend``, for a model decoded in this
process) and implements its steps; the kit owns everything the interface's contract needs done
the same way on every backend: input validation (``normalize_generation_input``), per-row
sampling (``resolve_sampling``), the reference decoding step (``sampling``), the output layout
(``build_generation_output``), the life cycle, the logger metrics, and the receiving side of
the weight transaction (``gen_backend_kit.weights``).

A training loop never imports this package: it pins ``gen-interface`` and picks a backend by
name. The guide to writing a backend is this package's README.
"""

from importlib.metadata import PackageNotFoundError, version

from gen_backend_kit.backend import GenerationBackend
from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_backend_kit.in_process import InProcessBackend
from gen_backend_kit.inputs import PromptBatch, normalize_generation_input
from gen_backend_kit.lifecycle import Lifecycle, LifecycleView, Resource
from gen_backend_kit.metrics import GenerationMetrics
from gen_backend_kit.outputs import FinishReason, RowResult, build_generation_output
from gen_backend_kit.row_sampling import (
    BatchSampling,
    GenerationCall,
    RowSampling,
    resolve_sampling,
)
from gen_backend_kit.scoring import ScoreBatch, ScoredRow, scored_row
from gen_backend_kit.stepping import RowControl, StepGate

try:
    __version__ = version("gen-backend-kit")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "BatchSampling",
    "FinishReason",
    "FleetHealth",
    "GenerationBackend",
    "GenerationCall",
    "GenerationMetrics",
    "InProcessBackend",
    "Lifecycle",
    "LifecycleView",
    "PromptBatch",
    "ReplicaState",
    "Resource",
    "RowControl",
    "RowResult",
    "RowSampling",
    "ScoreBatch",
    "ScoredRow",
    "StepGate",
    "__version__",
    "build_generation_output",
    "normalize_generation_input",
    "resolve_sampling",
    "scored_row",
]
