"""pytest plugin (entry point ``pytest11``): hypothesis profiles, the ``gpu`` marker, tiny models.

Profiles: ``dev`` (the default), ``ci`` (derandomized, chosen when ``CI`` is set) and ``nightly``
(many examples). ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME`` picks one.
Tests marked ``gpu`` are skipped when no CUDA device is present.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

from gen_testkit.models import TinyModel, build_tiny_model
from gen_testkit.servers import ServerProcess

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "nightly", max_examples=500, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is present")
    chosen = config.getoption("hypothesis_profile", default=None) or os.environ.get(
        "HYPOTHESIS_PROFILE"
    )
    settings.load_profile(chosen or ("ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], TinyModel]:
    """Build (once, cached on disk) a tiny model by preset name: ``tiny_model("tiny-llama")``."""
    pytest.importorskip("transformers", reason="tiny models need gen-testkit[models]")
    return build_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model: Callable[[str], TinyModel]) -> TinyModel:
    """The ``tiny-qwen2`` preset: Qwen2, hidden 128, 2 layers, vocab 512, float32."""
    return tiny_model("tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: Callable[[str], TinyModel]) -> TinyModel:
    """The ``tiny-llama`` preset: Llama, hidden 128, 2 layers, vocab 512, float32."""
    return tiny_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tiny_model: Callable[[str], TinyModel]) -> TinyModel:
    """The ``tiny-qwen2-tied`` preset: ``tiny-qwen2``'s shape with ``lm_head`` tied to the
    embeddings, so its checkpoint holds no ``lm_head.weight``."""
    return tiny_model("tiny-qwen2-tied")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_model: Callable[[str], TinyModel]) -> TinyModel:
    """The ``tiny-qwen3-moe`` preset: Qwen3-MoE, 2 layers of 8 experts, top-2, float32."""
    return tiny_model("tiny-qwen3-moe")


@pytest.fixture(scope="session")
def vllm_serve(tiny_qwen2: TinyModel) -> Iterator[ServerProcess]:
    """vLLM's own OpenAI server on ``tiny_qwen2`` (served as ``tiny``), on 127.0.0.1 and a free
    port, for the tests that compare with it: started once for the session (about 40 s here;
    idle, it costs about 1% of a core), stopped at its end."""
    pytest.importorskip("vllm")
    from gen_testkit.servers import VLLM_SERVE_ENV, free_port, vllm_serve_command

    port = free_port()
    command = vllm_serve_command(tiny_qwen2.path, port, served_model_name="tiny")
    server = ServerProcess(command, port, env=VLLM_SERVE_ENV, name="vllm-serve")
    server.wait_ready(timeout_s=600)
    yield server
    server.stop()
