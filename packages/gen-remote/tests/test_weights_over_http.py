"""Weights into a server through the remote backend, as one verified transaction with versions:
through shared memory when the server runs on this machine, through the collective path when
it runs on another (here: a server the client is told runs elsewhere)."""

from __future__ import annotations

import pytest
import torch
from gen_interface import create_generation_backend
from gen_interface.weights import Refitter
from gen_remote import ServerInfo
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from remote_servers import ServedModels, remote_config

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7]]


def _perturbed(model: TinyModel) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {
        name: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in model.state_dict().items()
    }


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_refit_over_shared_memory_is_a_versioned_transaction(
    served: ServedModels, tiny_qwen2: TinyModel, backend: str
):
    client = create_generation_backend(remote_config(served.get(backend, tiny_qwen2)))
    batch = pad_prompts(PROMPTS, "left")
    try:
        assert client.capabilities.weight_transports >= {"shm"}
        before = client.generate(batch, greedy=True)
        with Refitter(client) as refitter:
            assert not refitter.broadcasts
            new = refitter.refit(_perturbed(tiny_qwen2))
            changed = client.generate(batch, greedy=True)
            back = refitter.refit(tiny_qwen2.state_dict())
        assert back == new + 1 == client.weight_version
        assert changed["weight_version"].tolist() == [new] * len(PROMPTS)
        assert not torch.equal(changed["output_ids"], before["output_ids"])
        after = client.generate(batch, greedy=True)
        assert torch.equal(after["output_ids"], before["output_ids"])
        assert after["weight_version"].tolist() == [back] * len(PROMPTS)
    finally:
        client.shutdown()


def test_a_server_on_another_machine_is_refitted_through_the_collective_path(
    served: ServedModels, tiny_qwen2: TinyModel, monkeypatch: pytest.MonkeyPatch
):
    # the server answers /backend_info with this machine's name: the client is told otherwise
    monkeypatch.setattr(ServerInfo, "same_host", property(lambda self: False))
    client = create_generation_backend(remote_config(served.get("vllm", tiny_qwen2)))
    batch = pad_prompts(PROMPTS, "left")
    try:
        assert client.capabilities.weight_transports == {"collective"}
        assert any("collective path" in note for note in client.capabilities.notes)
        before = client.generate(batch, greedy=True)
        assert not client.collective_intact()  # the server's engine has joined no group yet
        with Refitter(client, collective_host="127.0.0.1", bucket_bytes=1 << 20) as refitter:
            assert refitter.broadcasts
            new = refitter.refit(_perturbed(tiny_qwen2))
            assert client.collective_intact()
            changed = client.generate(batch, greedy=True)
            back = refitter.refit(tiny_qwen2.state_dict())
        assert back == new + 1 == client.weight_version
        assert changed["weight_version"].tolist() == [new] * len(PROMPTS)
        assert not torch.equal(changed["output_ids"], before["output_ids"])
        assert torch.equal(client.generate(batch, greedy=True)["output_ids"], before["output_ids"])
        metrics = client.get_logger_metrics()
        assert metrics["refits_total"] == 2 and metrics["weight_version"] == back
    finally:
        client.shutdown()


def test_an_adapter_refit_over_http_serves_the_merged_model(tiny_qwen2: TinyModel):
    """A server whose backend serves a LoRA adapter takes adapter-only refits through the client
    (the server's setting: the client's config names no lora), and answers as the base model
    with the adapter merged."""
    from gen_testkit.adapters import merge_adapter, random_adapter
    from servers import hf_backend, serve

    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    server = serve(hf_backend(tiny_qwen2, lora=lora), tiny_qwen2)
    merged = hf_backend(tiny_qwen2)
    client = create_generation_backend(remote_config(server))
    batch = pad_prompts(PROMPTS, "left")
    try:
        adapter = random_adapter(tiny_qwen2.state_dict(), lora, seed=7)
        with Refitter(client) as refitter:
            version = refitter.refit(adapter)
        merged.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), adapter, lora))
        mine, theirs = client.generate(batch, greedy=True), merged.generate(batch, greedy=True)
        assert torch.equal(mine["output_ids"], theirs["output_ids"])
        torch.testing.assert_close(mine["logprobs"], theirs["logprobs"], atol=2e-5, rtol=0)
        assert mine["weight_version"].tolist() == [version] * len(PROMPTS)
    finally:
        client.shutdown()
        merged.shutdown()
        server.stop()
