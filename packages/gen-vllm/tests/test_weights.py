"""Weight updates through IPC handles on every replica, checked by checksums of what every
replica received, holds and computes with its packed layers."""

import pytest
import torch
from gen_interface import GenerationConfigError, WeightUpdateError
from gen_interface.weights import share_weights
from gen_testkit.strategies import pad_prompts
from gen_vllm.refit import verify_update

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1]]


@pytest.fixture(scope="module")
def backend(engines, tiny_qwen2):
    return engines.get(tiny_qwen2, replicas=2)


def _greedy(backend):
    return backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)


def test_an_update_reaches_every_replica_and_updating_back_restores(
    backend, tiny_qwen2, monkeypatch
):
    original = tiny_qwen2.state_dict()
    before = _greedy(backend)
    scaled = {k: v * 1.5 if k.endswith("proj.weight") else v for k, v in original.items()}
    finished = []
    real_finish = backend.replicas.finish_weight_update

    def spy():
        finished.append(real_finish())
        return finished[-1]

    monkeypatch.setattr(backend.replicas, "finish_weight_update", spy)
    with share_weights(scaled) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    reports = verify_update(finished[0])
    assert len(reports) == backend.num_replicas == 2
    assert len({r["received_checksum"] for r in reports}) == 1
    assert len({r["model_checksum"] for r in reports}) == 1
    # vLLM's CPU linear layers keep their weights packed, outside every parameter: what they
    # compute on a fixed input is compared instead, exactly, between replicas on equal kernels
    assert reports[0]["packed_checksum"] is not None
    assert len({(r["kernel"], r["packed_checksum"]) for r in reports}) == 1
    assert len({r["device_id"] for r in reports}) == 2  # two distinct worker processes
    changed = _greedy(backend)
    assert not torch.equal(changed["output_ids"], before["output_ids"])
    with share_weights(original) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    after = _greedy(backend)
    assert torch.equal(after["output_ids"], before["output_ids"])
    assert torch.equal(after["logprobs"], before["logprobs"])


def test_a_partial_update_is_refused_because_vllm_reloads_whole_layers(backend, tiny_qwen2):
    partial = {k: v for k, v in tiny_qwen2.state_dict().items() if "layers.1." not in k}
    before = _greedy(backend)
    with share_weights(partial) as shared, pytest.raises(WeightUpdateError, match="missing"):
        backend.update_weights_from_ipc_handles(shared.handles)
    assert torch.equal(_greedy(backend)["logprobs"], before["logprobs"])


def test_refit_info_is_checked_at_set_up(backend, tiny_qwen2):
    info = {k: (v.shape, v.dtype) for k, v in tiny_qwen2.state_dict().items()}
    backend.prepare_refit_info(info)
    info["model.norm.weight"] = (torch.Size([7]), torch.float32)
    with pytest.raises(WeightUpdateError, match=r"model\.norm\.weight"):
        backend.prepare_refit_info(info)


def test_with_sampling_front_ends_share_the_engines(backend):
    view = backend.with_sampling(temperature=0.0, max_new_tokens=3)
    assert view.replicas is backend.replicas and view.config["max_new_tokens"] == 3
    out = view.generate(pad_prompts(PROMPTS, "left"), greedy=False)  # temperature 0: greedy
    assert bool((out["generation_lengths"] <= 3).all())
    full = _greedy(backend)
    for i in range(len(PROMPTS)):
        n = int(out["unpadded_sequence_lengths"][i])
        assert out["output_ids"][i, :n].tolist() == full["output_ids"][i, :n].tolist()
    with pytest.raises(GenerationConfigError, match="logprobs_mode"):
        backend.with_sampling(logprobs_mode="processed")
    view.shutdown()
    assert _greedy(backend)["output_ids"].shape[0] == len(PROMPTS)  # the owner is untouched
