"""HfGeneration behaviour the conformance suite does not cover: the registry, capabilities,
stop strings with and without a tokenizer, chunking, the context limit and shutdown."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_interface import (
    BatchedDataDict,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    create_generation_backend,
)
from gen_testkit.compare import compare_generations, generated_rows
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from gen_testkit.tolerances import tolerance_for
from transformers import AutoTokenizer

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7, 7, 7, 7], [300, 12], [44] * 11, [3, 4], [250, 1, 9]]


@pytest.fixture(scope="module")
def backend(tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]) -> Iterator[HfGeneration]:
    backend = HfGeneration(make_config(tiny_qwen2, max_new_tokens=12, stop_token_ids=[]))
    yield backend
    backend.shutdown()


def assert_same_rows(a: BatchedDataDict[Any], b: BatchedDataDict[Any], what: str) -> None:
    tolerance = tolerance_for("float32", across_backends=False)
    compare_generations(
        a, b, logprob_atol=tolerance.logprob_atol, near_tie=tolerance.near_tie
    ).assert_ok(what)


def test_built_by_name_through_the_registry(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], backend: HfGeneration
):
    config = make_config(tiny_qwen2, max_new_tokens=12, stop_token_ids=[])
    by_name = create_generation_backend(config)
    assert isinstance(by_name, HfGeneration)
    batch = pad_prompts(PROMPTS, "left")
    assert_same_rows(
        backend.generate(batch, greedy=True), by_name.generate(batch, greedy=True), "by name"
    )
    by_name.shutdown()


def test_capabilities_on_the_cpu(backend: HfGeneration):
    caps = backend.capabilities
    assert caps.devices == ("cpu",)
    assert caps.weight_transports == {"shm", "state_dict"}
    assert caps.score and caps.stop_strings and not caps.sleep
    assert any("CPU" in note for note in caps.notes)


def test_larger_batches_run_in_chunks_with_the_same_rows(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], backend: HfGeneration
):
    chunked = HfGeneration(
        make_config(tiny_qwen2, max_new_tokens=12, stop_token_ids=[], hf_cfg={"max_batch_size": 2})
    )
    batch = pad_prompts(PROMPTS, "mixed")
    for greedy in (True, False):
        whole = backend.generate(batch, greedy=greedy)
        assert_same_rows(whole, chunked.generate(batch, greedy=greedy), f"greedy={greedy}")
    chunked.shutdown()


def test_context_limit_truncates_and_refuses_full_prompts(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    limited = HfGeneration(
        make_config(tiny_qwen2, max_new_tokens=8, stop_token_ids=[], hf_cfg={"max_model_len": 12})
    )
    output = limited.generate(pad_prompts([[5] * 4, [6] * 10], "right"), greedy=True)
    assert output["generation_lengths"].tolist() == [8, 2]
    assert output["truncated"].tolist() == [True, True]
    with pytest.raises(GenerationInputError, match="context limit"):
        limited.generate(pad_prompts([[5] * 12], "right"), greedy=True)
    limited.shutdown()


def _stop_string_for(tokenizer: Any, tokens: list[int]) -> tuple[str, int]:
    """A string that the decoded text of ``tokens`` first contains after token ``j``."""
    texts = [tokenizer.decode(tokens[: j + 1]) for j in range(len(tokens))]
    for j in range(2, len(tokens) - 1):
        for candidate in (texts[j][-2:], texts[j]):
            if candidate.strip() and all(candidate not in texts[k] for k in range(j)):
                return candidate, j
    raise AssertionError(f"no usable stop string in {texts}")


def _first_hit(tokenizer: Any, tokens: list[int], stop: str) -> int | None:
    return next((j for j in range(len(tokens)) if stop in tokenizer.decode(tokens[: j + 1])), None)


def test_stop_strings_end_rows_after_the_completing_token(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], backend: HfGeneration
):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen2.path))
    batch = pad_prompts(PROMPTS[:2], "left")
    free = generated_rows(backend.generate(batch, greedy=True))
    stop, j = _stop_string_for(tokenizer, free[0][0])

    per_row = backend.generate(BatchedDataDict(**batch, stop_strings=[[stop], None]), greedy=True)
    rows = generated_rows(per_row)
    assert rows[0][0] == free[0][0][: j + 1]
    assert rows[1][0] == free[1][0]
    assert per_row["truncated"].tolist() == [False, True]

    configured = HfGeneration(
        make_config(tiny_qwen2, max_new_tokens=12, stop_token_ids=[], stop_strings=[stop])
    )
    rows = generated_rows(configured.generate(batch, greedy=True))
    for i, (tokens, _) in enumerate(free):
        hit = _first_hit(tokenizer, tokens, stop)
        assert rows[i][0] == (tokens if hit is None else tokens[: hit + 1]), f"row {i}"
    configured.shutdown()


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_qwen2: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights and config without its tokenizer files."""
    target = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_qwen2.path / name, target / name)
    return target


def test_without_a_tokenizer_stop_strings_are_refused(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig], no_tokenizer_dir: Path
):
    config = make_config(tiny_qwen2, model_name=str(no_tokenizer_dir))
    with pytest.raises(GenerationConfigError, match="stop_strings"):
        HfGeneration({**config, "stop_strings": ["."]})
    with pytest.raises(GenerationConfigError, match="load_tokenizer"):
        HfGeneration({**config, "hf_cfg": {"load_tokenizer": True}})
    tokenless = HfGeneration(config)
    assert not tokenless.capabilities.stop_strings
    batch = pad_prompts([[5, 6], [7]], "left")
    with pytest.raises(GenerationInputError, match="stop_strings row 1"):
        tokenless.generate(BatchedDataDict(**batch, stop_strings=[None, ["x"]]), greedy=True)
    assert tokenless.generate(batch, greedy=True)["output_ids"].shape[0] == 2
    tokenless.shutdown()


def test_shutdown_is_idempotent_and_final(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    doomed = HfGeneration(make_config(tiny_qwen2))
    batch = pad_prompts([[5, 6]], "left")
    doomed.generate(batch, greedy=True)
    doomed.shutdown()
    doomed.shutdown()
    doomed.finish_generation()
    for call in (
        lambda: doomed.generate(batch, greedy=True),
        doomed.prepare_for_generation,
        doomed.state_dict,
        lambda: doomed.score(
            BatchedDataDict(
                input_ids=torch.tensor([[5, 6, 7]]),
                prompt_lengths=torch.tensor([2]),
                unpadded_sequence_lengths=torch.tensor([3]),
            )
        ),
    ):
        with pytest.raises(GenerationError, match="shut down"):
            call()


def test_with_sampling_shares_the_model_and_its_weights(
    backend: HfGeneration, tiny_qwen2: TinyModel
):
    batch = pad_prompts([[5, 6, 7], [9]], "left")
    greedy_view = backend.with_sampling(temperature=0.0, max_new_tokens=3)
    assert greedy_view.config["max_new_tokens"] == 3 != backend.config["max_new_tokens"]
    out = greedy_view.generate(batch, greedy=False)  # temperature 0: greedy
    expected = backend.generate(batch, greedy=True)
    assert out["output_ids"].tolist() == [
        row[: int(n)] + [0] * (out["output_ids"].shape[1] - int(n))
        for row, n in zip(expected["output_ids"].tolist(), out["unpadded_sequence_lengths"])
    ]
    with pytest.raises(GenerationConfigError, match="dtype"):
        backend.with_sampling(dtype="bfloat16")
    greedy_view.shutdown()
    assert backend.generate(batch, greedy=True)["output_ids"].shape[0] == 2  # owner unaffected
    with pytest.raises(GenerationError, match=r"front end .* is shut down"):
        greedy_view.generate(batch, greedy=True)


def test_with_sampling_front_ends_share_the_owners_lifecycle(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    owner = HfGeneration(make_config(tiny_qwen2))
    view = owner.with_sampling(max_new_tokens=2)
    batch = pad_prompts([[5, 6]], "left")
    owner.finish_generation()
    with pytest.raises(GenerationError, match="after finish_generation"):
        view.generate(batch, greedy=True)
    view.prepare_for_generation()  # a front end's prepare wakes the shared backend
    assert owner.generate(batch, greedy=True).size == 1
    owner.shutdown()
    with pytest.raises(GenerationError, match="shut down"):
        view.generate(batch, greedy=True)
