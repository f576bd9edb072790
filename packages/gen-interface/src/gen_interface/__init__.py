"""gen-interface: the generation interface an RL training loop pins.

Importing this package imports torch and nothing heavier: no ray, vllm or transformers.
"""

from importlib.metadata import PackageNotFoundError, version

from gen_interface.backend import GenerationBackend, GenerationCall
from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.config import (
    GENERATION_CONFIG_DEFAULTS,
    PER_CALL_SETTINGS,
    TokenizerLike,
    configure_generation_config,
    sampling_settings_of,
    validate_generation_config,
    with_per_call_overrides,
)
from gen_interface.errors import (
    BackendBrokenError,
    BackendUnavailableError,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    MixedWeightsError,
    StaleWeightsError,
    WeightsAbsentError,
    WeightUpdateError,
)
from gen_interface.events import RowEvent
from gen_interface.in_process import InProcessBackend
from gen_interface.inputs import PromptBatch, normalize_generation_input
from gen_interface.interface import (
    BackendCapabilities,
    GenerationInterface,
    InFlight,
    WeightTransport,
)
from gen_interface.lifecycle import Lifecycle
from gen_interface.outputs import FinishReason, RowResult, build_generation_output
from gen_interface.registry import (
    ENTRY_POINT_GROUP,
    available_backends,
    create_generation_backend,
    load_backend,
)
from gen_interface.row_sampling import BatchSampling, RowSampling, resolve_sampling
from gen_interface.specs import (
    ColocatedConfig,
    DType,
    GenerationConfig,
    GenerationDatumSpec,
    GenerationOutputSpec,
    LogprobsMode,
    ScoreSpec,
)

try:
    __version__ = version("gen-interface")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "GENERATION_CONFIG_DEFAULTS",
    "PER_CALL_SETTINGS",
    "BackendBrokenError",
    "BackendCapabilities",
    "BackendUnavailableError",
    "BatchSampling",
    "BatchedDataDict",
    "ColocatedConfig",
    "DType",
    "FinishReason",
    "GenerationBackend",
    "GenerationCall",
    "GenerationConfig",
    "GenerationConfigError",
    "GenerationDatumSpec",
    "GenerationError",
    "GenerationInputError",
    "GenerationInterface",
    "GenerationOutputSpec",
    "InFlight",
    "InProcessBackend",
    "Lifecycle",
    "LogprobsMode",
    "MixedWeightsError",
    "PromptBatch",
    "RowEvent",
    "RowResult",
    "RowSampling",
    "ScoreSpec",
    "StaleWeightsError",
    "TokenizerLike",
    "WeightTransport",
    "WeightUpdateError",
    "WeightsAbsentError",
    "__version__",
    "available_backends",
    "build_generation_output",
    "configure_generation_config",
    "create_generation_backend",
    "load_backend",
    "normalize_generation_input",
    "resolve_sampling",
    "sampling_settings_of",
    "validate_generation_config",
    "with_per_call_overrides",
]
