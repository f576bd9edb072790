"""The remote backend against vLLM's own server (``dialect: vllm``): generation, streaming,
top-k and scoring work and agree with the in-process reference; what vLLM's routes cannot give
(weight transactions, versions, a staleness bound) is stated in ``capabilities`` and refused by
name."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gen_interface import BatchedDataDict, GenerationConfigError, create_generation_backend
from gen_testkit.models import TinyModel
from gen_testkit.servers import ServerProcess
from gen_testkit.strategies import pad_prompts
from gen_testkit.tolerances import tolerance_for
from servers import hf_backend

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7]]
SETTINGS = {"top_logprobs": 2, "max_new_tokens": 8, "stop_token_ids": [2], "pad_token_id": 0}


@pytest.fixture(scope="module")
def pair(vllm_serve: ServerProcess, tiny_qwen2: TinyModel) -> Iterator[tuple[Any, Any]]:
    remote = create_generation_backend(
        {"backend": "remote", "remote_cfg": {"base_url": vllm_serve.url}, **SETTINGS}
    )
    local = hf_backend(tiny_qwen2, **SETTINGS)
    yield remote, local
    remote.shutdown()
    local.shutdown()


def test_it_is_recognised_and_says_what_it_cannot_do(pair: tuple[Any, Any]):
    remote, _ = pair
    caps = remote.capabilities
    assert remote.server.dialect == "vllm" and remote.config["model_name"] == "tiny"
    assert caps.score and caps.token_streaming and caps.async_generation
    assert not caps.weight_transports and not caps.in_flight_updates
    for call in (remote.start_weight_update, lambda: remote.announce_weight_version(1)):
        with pytest.raises(NotImplementedError, match="vLLM's own server"):
            call()
    with pytest.raises(GenerationConfigError, match="max_weight_staleness"):
        create_generation_backend({**remote.config, "max_weight_staleness": 1})


def test_greedy_rows_and_scores_match_the_reference(pair: tuple[Any, Any]):
    remote, local = pair
    atol = tolerance_for("float32", across_backends=True).logprob_atol
    batch = pad_prompts(PROMPTS, "left")
    theirs, ours = remote.generate(batch, greedy=True), local.generate(batch, greedy=True)
    assert torch.equal(theirs["output_ids"], ours["output_ids"])
    assert torch.equal(theirs["topk_ids"], ours["topk_ids"])
    torch.testing.assert_close(theirs["logprobs"], ours["logprobs"], atol=atol, rtol=0)
    scored = BatchedDataDict(
        input_ids=ours["output_ids"],
        prompt_lengths=torch.tensor([len(p) for p in PROMPTS]),
        unpadded_sequence_lengths=ours["unpadded_sequence_lengths"],
    )
    a, b = remote.score_top_logprobs(scored, 2), local.score_top_logprobs(scored, 2)
    assert torch.equal(a["topk_ids"], b["topk_ids"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=atol, rtol=0)


def test_seeded_rows_repeat_and_stream_as_they_come(pair: tuple[Any, Any]):
    remote = pair[0].with_sampling(seed=3)
    batch = pad_prompts(PROMPTS, "left")
    first, again = remote.generate(batch), remote.generate(batch)
    assert torch.equal(first["output_ids"], again["output_ids"])

    async def events() -> list[Any]:
        return [e async for e in remote.generate_stream(batch)]

    streamed = asyncio.run(events())
    for row in range(len(PROMPTS)):
        tokens = [t for e in streamed if e.index == row for t in e.token_ids]
        start = len(PROMPTS[row])
        end = int(first["unpadded_sequence_lengths"][row])
        assert tokens == first["output_ids"][row, start:end].tolist()
