"""Helpers for a backend's own config section: completing it, checking its values, the dtype.

A backend's config extends ``GenerationConfig`` with a section of its own (``vllm_cfg``,
``hf_cfg``, ...). ``complete_backend_settings`` validates the whole config against the backend's
schema and fills that section's defaults; ``check_int_setting`` refuses a bad value naming its
dotted path; ``resolve_dtype`` gives ``"auto"`` the one meaning every backend here shares.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gen_interface.config import validate_generation_config
from gen_interface.errors import GenerationConfigError
from gen_interface.schema import ForeignKeys

__all__ = ["check_int_setting", "complete_backend_settings", "resolve_dtype"]


def complete_backend_settings(
    config: Mapping[str, Any],
    key: str,
    defaults: Mapping[str, Any],
    *,
    schema: type,
    foreign: ForeignKeys | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate a backend's config against its ``schema`` and fill its own ``config[key]``.

    Returns:
        ``(a deep copy of config, its settings dict with every default filled)``; the caller
        checks the settings' values and stores them back under ``key``.

    Raises:
        GenerationConfigError: a key is unknown at any level, or a generation field is of the
            wrong type or out of range.
    """
    validate_generation_config(config, schema=schema, foreign=foreign)
    out = copy.deepcopy(dict(config))
    return out, {**copy.deepcopy(dict(defaults)), **(out.get(key) or {})}


def check_int_setting(
    settings: Mapping[str, Any], prefix: str, key: str, *, minimum: int = 1
) -> None:
    """Refuse ``settings[key]`` unless it is an integer >= ``minimum``, naming ``prefix.key``."""
    value = settings[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GenerationConfigError(
            f"{prefix}.{key} must be an integer >= {minimum}, got {value!r}"
        )


def resolve_dtype(model: str, dtype: str) -> str:
    """``"auto"`` means the checkpoint's dtype, as in every backend of this project.

    vLLM's and SGLang's own "auto" turn float32 checkpoints into 16-bit types, which would make
    the same config give different numbers on different backends.
    """
    if dtype != "auto":
        return dtype
    config_file = Path(model) / "config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        found = saved.get("dtype") or saved.get("torch_dtype")
        if isinstance(found, str) and found in ("float32", "bfloat16", "float16"):
            return found
    return "auto"
