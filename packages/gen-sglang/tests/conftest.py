"""SGLang backends shared by the tests: one server per logprobs mode for the whole session
(each start takes about 30 s on this machine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from gen_sglang import SglangGeneration
from gen_testkit.conformance import conformance_config
from gen_testkit.models import TinyModel

SglangBackends = Callable[[str], SglangGeneration]


@pytest.fixture(scope="session")
def sglang_backends(tiny_qwen2: TinyModel) -> Iterator[SglangBackends]:
    """``get(logprobs_mode)``: the session's SGLang backend on ``tiny_qwen2`` in that mode,
    started on first use, built from the conformance config."""
    built: dict[str, SglangGeneration] = {}

    def get(mode: str) -> SglangGeneration:
        if mode not in built:
            built[mode] = SglangGeneration(
                conformance_config(
                    backend="sglang",
                    model_name=str(tiny_qwen2.path),
                    vocab_size=tiny_qwen2.vocab_size,
                    logprobs_mode=mode,
                )
            )
        return built[mode]

    yield get
    for backend in built.values():
        backend.shutdown()
