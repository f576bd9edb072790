"""Every installed backend pair, on hypothesis-drawn batches and sampling settings, agrees
within the tolerances of ``gen_testkit.tolerances`` (per dtype, one place)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from gen_interface import (
    GenerationInterface,
    available_backends,
    configure_generation_config,
    create_generation_backend,
)
from gen_testkit.parity import HfLogitsOracle, PairReport, TimedBackend
from gen_testkit.parity.runner import compare_batch
from gen_testkit.parity.workload import ParityBatch
from gen_testkit.strategies import generation_batches
from gen_testkit.tolerances import tolerance_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: Backends that load Hugging Face models, the reference first.
MODEL_BACKENDS = [name for name in ("hf", "vllm") if name in available_backends()]
PAIRS = [(MODEL_BACKENDS[0], other) for other in MODEL_BACKENDS[1:]]
#: Examples per dtype: bfloat16 runs several times slower on CPUs.
EXAMPLES = {"float32": 12, "bfloat16": 4}

pytestmark = pytest.mark.skipif(not PAIRS, reason="needs two backends that load HF models")


@contextlib.contextmanager
def built_backends(names, model, **engine_settings) -> Iterator[dict[str, GenerationInterface]]:
    """``{name: backend}`` for ``model`` with the given engine-level settings; all shut down
    on exit. vLLM engines get a small KV cache so that they fit beside other tests' engines."""
    tokenizer = type(
        "Ids", (), {"pad_token_id": model.pad_token_id, "eos_token_id": model.eos_token_id}
    )()
    built: dict[str, GenerationInterface] = {}
    try:
        for name in names:
            config = {"backend": name, "model_name": str(model.path), **engine_settings}
            options = {}
            if name == "vllm":
                config["vllm_cfg"] = {"cpu_kv_cache_gib": 0.25}
                options["use_gpus"] = False  # the session's Ray also counts logical GPUs
            built[name] = create_generation_backend(
                configure_generation_config(config, tokenizer), **options
            )
        yield built
    finally:
        for backend in built.values():
            backend.shutdown()


@pytest.fixture(scope="module")
def oracles(tiny_qwen2):
    cache: dict[str, HfLogitsOracle] = {}

    def get(dtype: str) -> HfLogitsOracle:
        if dtype not in cache:
            cache[dtype] = HfLogitsOracle(str(tiny_qwen2.path), dtype)
        return cache[dtype]

    return get


def _sampling(vocab_size: int) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "max_new_tokens": st.integers(1, 12),
            "temperature": st.floats(0.3, 1.5),
            "top_k": st.one_of(st.none(), st.integers(1, 80)),
            "top_p": st.floats(0.3, 1.0),
            "stop_token_ids": st.lists(st.integers(3, vocab_size - 1), max_size=20),
            "seed": st.integers(0, 2**31 - 1),
        }
    )


def _with_sampling(backend, overrides: dict):
    derive = getattr(backend, "with_sampling", None)
    if derive is None:
        pytest.skip(f"{type(backend).__name__} cannot change sampling settings per call")
    return derive(**overrides)


@pytest.mark.parametrize("dtype", list(EXAMPLES))
@pytest.mark.parametrize(("reference", "candidate"), PAIRS)
def test_backends_agree(oracles, tiny_qwen2, dtype, reference, candidate):
    with built_backends(
        (reference, candidate), tiny_qwen2, dtype=dtype, logprobs_mode="processed"
    ) as engines:
        _check_agreement(
            engines, oracles(dtype), tiny_qwen2.vocab_size, dtype, reference, candidate
        )


def _check_agreement(engines, oracle, vocab, dtype, reference, candidate):
    tolerance = tolerance_for(dtype, across_backends=True)

    @settings(
        max_examples=EXAMPLES[dtype],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(drawn=generation_batches(vocab, max_rows=5, max_length=12), sampling=_sampling(vocab))
    def agree(drawn, sampling):
        report = PairReport(reference, candidate, dtype, tolerance)
        compare_batch(
            report,
            TimedBackend(reference, _with_sampling(engines[reference], sampling)),
            TimedBackend(candidate, _with_sampling(engines[candidate], sampling)),
            ParityBatch(drawn.data, drawn.prompts),
            oracle,
        )
        report.judge()
        assert report.ok, "\n".join(report.failures)

    agree()
