"""``return_routed_experts`` on vLLM (CPU: read in the worker, ``gen_vllm.routing``), checked
against transformers' own routers and across backends on the tiny MoE preset.

- The testkit's routing properties: every position vLLM read, greedy or sampled, generated or
  scored, routes as transformers routes the row's tokens (one pass, no cache), except where the
  router's k-th and (k+1)-th logits are within the near-tie margin.
- Sampled rows of each backend, teacher-forced through the other's ``score``: the same experts.
- A prompt served twice (the prefix cache holds it the second time) routes the same, whole.
- Refused cleanly: without ``enforce_eager``, and on an engine with no MoE layer.
"""

from __future__ import annotations

import time

import pytest
import torch
from gen_interface import BatchedDataDict, GenerationConfigError
from gen_testkit.conformance import ConformanceSubject
from gen_testkit.routing import compare_routing, reference_routing
from gen_testkit.strategies import pad_prompts, score_batch
from gen_testkit.suite.routed_experts import RoutedExpertsProperties
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7, 7, 7, 7], [300, 12, 40, 41, 43], [1, 2]]


@pytest.fixture(scope="module")
def vllm_moe(engines, tiny_qwen3_moe):
    return engines.get(tiny_qwen3_moe, return_routed_experts=True)


@pytest.fixture(scope="module")
def hf_moe(tiny_qwen3_moe):
    from gen_hf import HfGeneration
    from gen_testkit.conformance import conformance_config

    backend = HfGeneration(
        conformance_config(
            backend="hf",
            model_name=str(tiny_qwen3_moe.path),
            vocab_size=tiny_qwen3_moe.vocab_size,
            return_routed_experts=True,
        )
    )
    yield backend
    backend.shutdown()


def _generated(out: BatchedDataDict) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each row's sequence and its routing over the positions the model read (all but the
    last token)."""
    totals = out["unpadded_sequence_lengths"].tolist()
    sequences = [out["output_ids"][i, :n].tolist() for i, n in enumerate(totals)]
    return sequences, [out["routed_experts"][i, : n - 1] for i, n in enumerate(totals)]


class TestQwen3Moe(RoutedExpertsProperties):
    """The testkit's routing properties on vLLM's routing, read in the worker."""

    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, vllm_moe, tiny_qwen3_moe):
        return ConformanceSubject.for_model(vllm_moe, tiny_qwen3_moe)


def test_sampled_rows_route_the_same_teacher_forced_through_the_other_backend(vllm_moe, hf_moe):
    data = pad_prompts(PROMPTS, "left")
    data["sample_seeds"] = torch.arange(100, 100 + len(PROMPTS))
    lengths = [len(p) for p in PROMPTS]
    for producer, scorer in ((vllm_moe, hf_moe), (hf_moe, vllm_moe)):
        sequences, got = _generated(producer.generate(data))
        scored = scorer.score_top_logprobs(score_batch(sequences, lengths), 0)["routed_experts"]
        same = [
            bool(torch.equal(mine, scored[i, : len(sequences[i]) - 1]))
            for i, mine in enumerate(got)
        ]
        # Both sides are float32 on one model: a near-tie split would show as one row off;
        # none is expected on these rows (measured: none).
        assert all(same), (type(producer).__name__, same)


def test_score_routes_every_position_like_gen_hf(vllm_moe, hf_moe):
    sequences = [[*p, 11, 12, 13] for p in PROMPTS]
    lengths = [len(p) for p in PROMPTS]
    mine, theirs = (
        b.score_top_logprobs(score_batch(sequences, lengths), 0)["routed_experts"]
        for b in (vllm_moe, hf_moe)
    )
    assert torch.equal(mine, theirs)
    assert all((mine[i, : len(s)] >= 0).all() for i, s in enumerate(sequences))


def test_a_prompt_the_prefix_cache_holds_still_routes_whole(vllm_moe):
    prompt = [(7 * i) % 400 + 3 for i in range(160)]  # longer than a few KV blocks
    data = pad_prompts([prompt], "right")
    first, second = (vllm_moe.generate(data, greedy=True) for _ in range(2))
    assert torch.equal(first["output_ids"], second["output_ids"])
    assert torch.equal(first["routed_experts"], second["routed_experts"])
    assert (first["routed_experts"][0, : len(prompt)] >= 0).all()


def test_without_enforce_eager_cpu_refuses_and_gpus_use_vllms_own_option(tiny_qwen3_moe):
    from gen_testkit.conformance import conformance_config
    from gen_vllm import VllmGeneration
    from gen_vllm.engine_args import engine_args_for, engine_env

    config = VllmGeneration.complete_config(
        conformance_config(
            backend="vllm",
            model_name=str(tiny_qwen3_moe.path),
            vocab_size=tiny_qwen3_moe.vocab_size,
            return_routed_experts=True,
            vllm_cfg={"enforce_eager": False},
        )
    )
    with pytest.raises(GenerationConfigError, match="enforce_eager to true"):
        engine_args_for(config, use_gpus=False)
    assert engine_args_for(config, use_gpus=True)["enable_return_routed_experts"] is True
    assert engine_env(config, use_gpus=True) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    eager = VllmGeneration.complete_config(dict(config, vllm_cfg={"enforce_eager": True}))
    assert "enable_return_routed_experts" not in engine_args_for(eager, use_gpus=True)


def test_vllms_own_option_on_gpus_gives_the_same_output(own, tiny_qwen3_moe):
    """With compiled forwards on GPUs (the fake engine follows vLLM's contract: a finished
    request's ``routed_experts``, every position read), rows carry the routing as in eager
    mode: transformers' routers on the same tokens."""
    backend = own.backend(
        own.cluster([1]),
        tiny_qwen3_moe,
        extra={"return_routed_experts": True},
        enforce_eager=False,
    )
    from fake_backends import pid_of
    from fake_vllm_engine import read_events

    mine = [e for e in read_events(own.log_dir) if e["pid"] == pid_of(backend)]
    start = next(e for e in mine if e["event"] == "start")
    assert start["routed_experts"] and start["v2_runner"] == "1"
    out = backend.generate(pad_prompts(PROMPTS, "right"), greedy=True)
    sequences, got = _generated(out)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe.path), dtype=torch.float32)
    result = compare_routing(got, [reference_routing(model, s, 2) for s in sequences])
    assert result.compared == 2 * sum(len(s) - 1 for s in sequences)
    assert result.equal == result.compared, result


def test_an_engine_without_moe_layers_refuses_and_leaves_nothing_running(
    own, ray_session, tiny_qwen2
):
    named = set(ray_session.util.list_named_actors())
    cluster = own.cluster([1])
    with pytest.raises(GenerationConfigError, match="has no MoE layer; set it to false"):
        own.backend(cluster, tiny_qwen2, extra={"return_routed_experts": True})
    deadline = time.monotonic() + 30
    while set(ray_session.util.list_named_actors()) != named and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(ray_session.util.list_named_actors()) == named
