"""Speculative decoding is the server's setting: a remote client of a gen-serve server over the
speculating n-gram backend takes the server's ``speculative`` when it leaves it out, refuses a
different one by name, returns the greedy rows a local speculating backend returns, and reports
the server's ``speculative_*`` metrics in its own ``get_logger_metrics()``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fleet_backend import VOCAB, ngram_app, ngram_config
from gen_interface import GenerationConfigError, create_generation_backend
from gen_remote.server import ServerInfo
from gen_remote.speculation import check_speculation
from gen_testkit.compare import generated_rows
from gen_testkit.config_checks import for_backend
from gen_testkit.conformance import conformance_config
from gen_testkit.ngram import NgramGeneration
from gen_testkit.strategies import pad_prompts
from servers import ServerThread
from speculating_backend import SPECULATIVE, speculating_config, speculating_server

PROMPTS = [[5, 6, 7, 9], [11, 2], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    yield from speculating_server()


def client_config(server: ServerThread, **extra: Any) -> dict[str, Any]:
    """The conformance config for a remote client of ``server``, ``speculative`` left out."""
    config = conformance_config(
        backend="remote", model_name="ngram", vocab_size=VOCAB, remote_cfg={"base_url": server.url}
    )
    return {**config, **extra}


@pytest.fixture
def remote(server: ServerThread) -> Iterator[Any]:
    client = create_generation_backend(client_config(server))
    yield client
    client.shutdown()


def test_a_client_that_leaves_speculative_out_takes_the_servers(remote):
    assert remote.config["speculative"] == SPECULATIVE
    assert remote.capabilities.speculative == frozenset({"draft_model"})


def test_a_client_with_the_servers_speculative_is_accepted(server):
    client = create_generation_backend(client_config(server, speculative=dict(SPECULATIVE)))
    try:
        assert client.config["speculative"] == SPECULATIVE
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    "theirs",
    [
        None,
        {**SPECULATIVE, "num_speculative_tokens": 5},
        {"method": "ngram", "num_speculative_tokens": 3},
    ],
)
def test_a_different_speculative_is_refused_saying_what_the_server_runs(server, theirs):
    with pytest.raises(GenerationConfigError) as refused:
        create_generation_backend(client_config(server, speculative=theirs))
    message = str(refused.value)
    assert message.startswith(f"speculative is {theirs!r} here")
    assert f"runs speculative {SPECULATIVE!r}" in message
    assert "leave speculative out" in message


def test_greedy_rows_equal_a_local_speculating_backends(remote):
    local = NgramGeneration(
        {**for_backend(remote.config, "ngram"), "ngram": speculating_config()["ngram"]}  # type: ignore[typeddict-item]
    )
    try:
        assert local.config["speculative"] == SPECULATIVE
        batch = pad_prompts(PROMPTS, "left", pad_token_id=remote.config["pad_token_id"])
        expected = local.generate(batch, greedy=True)
        actual = remote.generate(batch, greedy=True)
    finally:
        local.shutdown()
    for (want, want_logprobs), (got, got_logprobs) in zip(
        generated_rows(expected), generated_rows(actual), strict=True
    ):
        assert got == want
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs))
    assert all(len(tokens) > 1 for tokens, _ in generated_rows(expected))
    assert local.get_logger_metrics()["speculative_drafts_total"] > 0


def test_the_servers_speculation_metrics_reach_the_clients_logger_metrics(server, remote):
    served = server.state.backend
    before = served.get_logger_metrics()
    start = remote.get_logger_metrics()
    assert start["speculative_drafts_total"] == 0  # counted from when the client connected
    batch = pad_prompts(PROMPTS, "right", pad_token_id=remote.config["pad_token_id"])
    remote.generate(batch, greedy=True)
    after = served.get_logger_metrics()
    seen = remote.get_logger_metrics()
    for name in (
        "speculative_drafts_total",
        "speculative_proposed_tokens_total",
        "speculative_accepted_tokens_total",
    ):
        assert seen[name] == after[name] - before[name]
    assert seen["speculative_drafts_total"] > 0
    rate = seen["speculative_accepted_tokens_total"] / seen["speculative_proposed_tokens_total"]
    assert seen["speculative_acceptance_rate"] == pytest.approx(rate)
    assert seen["speculative_mean_accepted_length"] == pytest.approx(
        1 + seen["speculative_accepted_tokens_total"] / seen["speculative_drafts_total"]
    )
    assert seen["speculative_drafter_weight_version"] == 0
    remote.clear_logger_metrics()
    cleared = remote.get_logger_metrics()
    assert cleared["speculative_drafts_total"] == 0
    assert cleared["speculative_acceptance_rate"] == 0.0


def test_a_server_that_does_not_speculate_refuses_a_clients_speculative():
    backend = NgramGeneration(ngram_config())  # type: ignore[arg-type]
    plain = ServerThread(ngram_app(backend))
    try:
        with pytest.raises(GenerationConfigError, match="runs no speculative decoding"):
            create_generation_backend(client_config(plain, speculative=dict(SPECULATIVE)))
        client = create_generation_backend(client_config(plain))
        try:
            assert client.config["speculative"] is None
            assert client.capabilities.speculative == frozenset()
            assert not any(k.startswith("speculative_") for k in client.get_logger_metrics())
        finally:
            client.shutdown()
    finally:
        plain.stop()
        backend.shutdown()


def test_vllms_own_server_takes_no_speculative_from_a_client():
    vllm = ServerInfo(dialect="vllm", model_name="m", backend="vllm", host=None)
    with pytest.raises(GenerationConfigError, match="vLLM's own server does not say"):
        check_speculation({"speculative": dict(SPECULATIVE)}, vllm)
    check_speculation({"speculative": None}, vllm)  # left out: nothing to refuse
    assert vllm.backend_capabilities().speculative == frozenset()
