"""gen-sglang: SGLang behind the gen-interface, driven over SGLang's own HTTP API.

``create_generation_backend({"backend": "sglang", "model_name": "/path/to/model"})`` starts an
SGLang server from SGLang's own environment (made on first use on the CPU, or
``sglang_cfg.python``) and returns a ``SglangGeneration``.
"""

from gen_sglang.backend import SglangGeneration
from gen_sglang.config import SGLANG_CFG_DEFAULTS, SglangConfig, SglangSettings

__all__ = ["SGLANG_CFG_DEFAULTS", "SglangConfig", "SglangGeneration", "SglangSettings"]
