"""gen-vllm: vLLM engines as Ray actors behind the generation interface.

Importing this package does not import vLLM or start Ray; building a ``RayVirtualCluster`` or a
``VllmGeneration`` does.
"""

from importlib.metadata import PackageNotFoundError, version

from gen_vllm.cluster import RayVirtualCluster
from gen_vllm.config import VLLM_CFG_DEFAULTS, VllmConfig, VllmSpecificArgs
from gen_vllm.extension import UpdatableVllmInternalWorker
from gen_vllm.generation import VllmGeneration
from gen_vllm.worker import VllmGenerationWorker

try:
    __version__ = version("gen-vllm")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "VLLM_CFG_DEFAULTS",
    "RayVirtualCluster",
    "UpdatableVllmInternalWorker",
    "VllmConfig",
    "VllmGeneration",
    "VllmGenerationWorker",
    "VllmSpecificArgs",
    "__version__",
]
