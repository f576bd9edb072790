"""Speculative decoding through gen-serve: the backend's ``speculative`` section and offered
methods in ``/backend_info``, its ``speculative_*`` metrics on ``/metrics`` typed (counters and
gauges, with help) and under vLLM's names too, and ``--speculative`` on the command line."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
from gen_serve.cli import parse_args, serve_backend_config
from prometheus_client.parser import text_string_to_metric_families
from servers import ServerThread
from speculating_backend import SPECULATIVE, speculating_server

PROMPT = [5, 6, 7, 9]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    yield from speculating_server()


def families(server: ServerThread) -> dict[str, Any]:
    """``/metrics``' metric families by name."""
    with server.client() as client:
        answer = client.get("/metrics")
    assert answer.status_code == 200, answer.text
    return {family.name: family for family in text_string_to_metric_families(answer.text)}


def sample_value(family: Any) -> float:
    (sample,) = family.samples
    assert sample.labels == {"model_name": "ngram"}
    return float(sample.value)


def test_backend_info_reports_the_speculative_section_and_offered_methods(server):
    with server.client() as client:
        info = client.get("/backend_info").json()
    assert info["config"]["speculative"] == SPECULATIVE
    assert info["capabilities"]["speculative"] == ["draft_model"]


def test_a_greedy_call_reaches_metrics_as_typed_speculation_counters(server):
    with server.client() as client:
        answer = client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
    assert answer.status_code == 200, answer.text
    found = families(server)
    counts = server.state.backend.get_logger_metrics()
    assert counts["speculative_drafts_total"] > 0
    for name in ("drafts", "proposed_tokens", "accepted_tokens"):
        family = found[f"gen:backend_speculative_{name}"]  # the parser drops a counter's _total
        assert family.type == "counter"
        assert family.documentation.startswith("Speculative decoding: ")
        assert sample_value(family) == counts[f"speculative_{name}_total"]
    for name in ("acceptance_rate", "mean_accepted_length"):
        family = found[f"gen:backend_speculative_{name}"]
        assert family.type == "gauge"
        assert family.documentation.startswith("Speculative decoding: ")
        assert sample_value(family) == pytest.approx(counts[f"speculative_{name}"])
    assert counts["speculative_proposed_tokens_total"] == 3 * counts["speculative_drafts_total"]
    # vLLM's names, for dashboards made for vllm serve
    vllm_names = {
        "vllm:spec_decode_num_drafts": "speculative_drafts_total",
        "vllm:spec_decode_num_draft_tokens": "speculative_proposed_tokens_total",
        "vllm:spec_decode_num_accepted_tokens": "speculative_accepted_tokens_total",
    }
    for vllm_name, ours in vllm_names.items():
        assert found[vllm_name].type == "counter"
        assert sample_value(found[vllm_name]) == counts[ours]
    # the n-gram backend's own extra stays an untyped gauge of the backend's values
    drafter = found["gen:backend_speculative_drafter_weight_version"]
    assert (drafter.type, sample_value(drafter)) == ("gauge", 0.0)


def _config(*argv: str) -> dict[str, Any]:
    args: argparse.Namespace = parse_args(["--backend", "vllm", "--model", "m", *argv])
    return serve_backend_config(args)


def test_the_speculative_flag_sets_the_configs_section():
    section = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert _config("--speculative", section)["speculative"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    assert "speculative" not in _config()


@pytest.mark.parametrize("bad", ["{method: ngram}", '["ngram"]'])
def test_a_speculative_flag_that_is_not_a_json_object_is_refused(bad):
    with pytest.raises(SystemExit, match="--speculative must be a JSON object"):
        _config("--speculative", bad)
