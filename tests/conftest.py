"""Backends for the cross-package tests, built through the registry like a user would."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from gen_interface import (
    GenerationInterface,
    configure_generation_config,
    create_generation_backend,
)

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@contextlib.contextmanager
def built_backends(names, model, **settings) -> Iterator[dict[str, GenerationInterface]]:
    """``{name: backend}`` for ``model`` with the given engine-level settings; all shut down
    on exit. vLLM engines get a small KV cache so that they fit beside other tests' engines."""
    tokenizer = type(
        "Ids", (), {"pad_token_id": model.pad_token_id, "eos_token_id": model.eos_token_id}
    )()
    built: dict[str, GenerationInterface] = {}
    try:
        for name in names:
            config = {"backend": name, "model_name": str(model.path), **settings}
            if name == "vllm":
                config["vllm_cfg"] = {"cpu_kv_cache_gib": 0.25}
            built[name] = create_generation_backend(configure_generation_config(config, tokenizer))
        yield built
    finally:
        for backend in built.values():
            backend.shutdown()


@pytest.fixture(scope="session")
def build_backends():
    """The ``built_backends`` context manager, for tests to build backends by name."""
    return built_backends
