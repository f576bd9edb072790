"""Routed experts over the wire: a ``remote`` client of a server whose backend returns them
passes the testkit's routing properties and returns exactly what that backend returns in
process (generate, greedy and sampled, and score); asking for them of a server that returns
none is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gen_interface import GenerationConfigError, create_generation_backend
from gen_testkit.conformance import ConformanceSubject, conformance_config
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts, score_batch
from gen_testkit.suite.routed_experts import RoutedExpertsProperties
from remote_servers import remote_config
from servers import ServerThread, hf_backend, serve

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7, 7, 7, 7], [300, 12, 40, 41, 43]]


@pytest.fixture(scope="module")
def moe_server(tiny_qwen3_moe: TinyModel) -> Iterator[ServerThread]:
    server = serve(
        hf_backend(tiny_qwen3_moe, return_routed_experts=True, max_new_tokens=8), tiny_qwen3_moe
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(moe_server: ServerThread) -> Iterator[Any]:
    backend = create_generation_backend(remote_config(moe_server, max_new_tokens=8))
    yield backend
    backend.shutdown()


class TestOverHf(RoutedExpertsProperties):
    """The testkit's routing properties through the client."""

    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(
        cls, moe_server: ServerThread, tiny_qwen3_moe: TinyModel
    ) -> Iterator[ConformanceSubject]:
        config = conformance_config(
            backend="remote",
            model_name="tiny",  # the server's name for it
            vocab_size=tiny_qwen3_moe.vocab_size,
            remote_cfg={"base_url": moe_server.url},
        )
        subject = ConformanceSubject(create_generation_backend(config), tiny_qwen3_moe.vocab_size)
        yield subject
        subject.backend.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def reference_model(cls, tiny_qwen3_moe: TinyModel) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe.path), dtype=torch.float32)


@pytest.mark.parametrize("greedy", [True, False])
def test_generated_rows_carry_the_servers_backend_routing(
    client: Any, moe_server: ServerThread, greedy: bool
):
    data = pad_prompts(PROMPTS, "left")
    data["sample_seeds"] = torch.arange(len(PROMPTS))
    local = moe_server.state.backend.generate(data, greedy=greedy)
    remote = client.generate(data, greedy=greedy)
    assert torch.equal(remote["output_ids"], local["output_ids"])
    assert remote["routed_experts"].dtype == torch.int16
    assert torch.equal(remote["routed_experts"], local["routed_experts"])


def test_score_carries_every_positions_routing(client: Any, moe_server: ServerThread):
    sequences = [[*p, 11, 12] for p in PROMPTS]
    data = score_batch(sequences, [len(p) for p in PROMPTS])
    local = moe_server.state.backend.score_top_logprobs(data, 0)["routed_experts"]
    assert torch.equal(client.score_top_logprobs(data, 0)["routed_experts"], local)


def test_asking_a_server_that_returns_none_is_refused(served: Any, tiny_qwen2: TinyModel):
    server = served.get("hf", tiny_qwen2)
    with pytest.raises(GenerationConfigError, match="return_routed_experts is True here"):
        create_generation_backend(remote_config(server, return_routed_experts=True))
