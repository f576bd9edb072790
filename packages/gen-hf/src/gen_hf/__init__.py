"""gen-hf: the Hugging Face transformers reference backend of gen-interface.

``HfGeneration`` runs any causal LM that transformers loads, in process, with its own decoding
loop on the model's KV cache. It is registered as the ``hf`` backend, so
``gen_interface.create_generation_backend({"backend": "hf", ...})`` builds it.
"""

from importlib.metadata import PackageNotFoundError, version

from gen_hf.backend import HfGeneration
from gen_hf.config import HF_CFG_DEFAULTS, HfConfig, HfSpecificArgs, complete_hf_config

try:
    __version__ = version("gen-hf")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "HF_CFG_DEFAULTS",
    "HfConfig",
    "HfGeneration",
    "HfSpecificArgs",
    "__version__",
    "complete_hf_config",
]
