"""gen-interface: the generation interface an RL training loop pins.

What a training loop uses and nothing more: the abstract ``GenerationInterface`` and its
capabilities, the config and batch types, ``BatchedDataDict``, config validation, backend
discovery by entry point, the errors, the per-row seeds, and (in ``gen_interface.weights``) the
trainer's side of weight sharing: ``Refitter``, ``WeightBroadcaster`` and the handle format.

Importing it imports torch and nothing heavier: no ray, vllm or transformers, and no backend or
backend kit (``gen-backend-kit`` holds what only backend authors use).
"""

from importlib.metadata import PackageNotFoundError, version

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
    NoReplicaServingError,
    RowLostError,
    StaleWeightsError,
    WeightBaseError,
    WeightsAbsentError,
    WeightUpdateError,
)
from gen_interface.events import RowEvent
from gen_interface.interface import (
    BackendCapabilities,
    GenerationInterface,
    InFlight,
    WeightTransport,
)
from gen_interface.registry import (
    ENTRY_POINT_GROUP,
    available_backends,
    create_generation_backend,
    load_backend,
)
from gen_interface.specs import (
    ColocatedConfig,
    DraftSampleMethod,
    DType,
    GenerationConfig,
    GenerationDatumSpec,
    GenerationOutputSpec,
    LogprobsMode,
    ScoreOutputSpec,
    ScoreSpec,
    SpeculativeConfig,
    SpeculativeMethod,
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
    "BatchedDataDict",
    "ColocatedConfig",
    "DType",
    "DraftSampleMethod",
    "GenerationConfig",
    "GenerationConfigError",
    "GenerationDatumSpec",
    "GenerationError",
    "GenerationInputError",
    "GenerationInterface",
    "GenerationOutputSpec",
    "InFlight",
    "LogprobsMode",
    "MixedWeightsError",
    "NoReplicaServingError",
    "RowEvent",
    "RowLostError",
    "ScoreOutputSpec",
    "ScoreSpec",
    "SpeculativeConfig",
    "SpeculativeMethod",
    "StaleWeightsError",
    "TokenizerLike",
    "WeightBaseError",
    "WeightTransport",
    "WeightUpdateError",
    "WeightsAbsentError",
    "__version__",
    "available_backends",
    "configure_generation_config",
    "create_generation_backend",
    "load_backend",
    "sampling_settings_of",
    "validate_generation_config",
    "with_per_call_overrides",
]
