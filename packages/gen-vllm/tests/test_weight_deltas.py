"""Delta refits on vLLM (``vllm_cfg.weight_deltas``): every worker keeps a readable copy of the
last committed weights and stages each update there, so the testkit's delta properties and its
weight-update checks hold on a real engine (the copy, the staging and the reload at the commit in
``transfer.py``) and on fake engines of two replicas of two tensor-parallel ranks (the copies of
every rank and replica compared); the collective path sends deltas too."""

from __future__ import annotations

import pytest
import torch
from gen_interface.weights import WeightBroadcaster
from gen_testkit.conformance import ConformanceSubject
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.capabilities import CapabilityProperties
from gen_testkit.suite.deltas import WeightDeltaProperties

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1]]


class TestDeltasOnAnEngine(CapabilityProperties, WeightDeltaProperties):
    claims_weight_updates = True
    claims_weight_deltas = True
    claims_score = True
    stages_whole_updates = True  # every update is staged in the copy until its commit

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=1, vllm_cfg={"weight_deltas": True})
        return ConformanceSubject.for_model(backend, tiny_qwen2)


class TestDeltasOnFakeReplicas(WeightDeltaProperties):
    """Two replicas of two tensor-parallel ranks, each rank with a copy of its own."""

    claims_weight_updates = True
    claims_weight_deltas = True
    stages_whole_updates = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, fake_engine_shipped, tiny_qwen2, tmp_path_factory):
        from fake_backends import FakeBackends

        made = FakeBackends(fake_engine_shipped, tmp_path_factory.mktemp("delta_events"))
        cluster = made.cluster([4])
        backend = made.backend(
            cluster, tiny_qwen2, tensor_parallel_size=2, weight_deltas=True, name_prefix="delta"
        )
        assert backend.num_replicas == 2
        yield ConformanceSubject.for_model(backend, tiny_qwen2)
        made.close()


def test_the_collective_path_sends_deltas_and_loads_what_a_whole_refit_loads(engines, tiny_qwen2):
    backend = engines.get(tiny_qwen2, replicas=1, vllm_cfg={"weight_deltas": True})
    weights = {k: v.clone() for k, v in tiny_qwen2.state_dict().items()}
    moved = {k: v.clone() for k, v in weights.items()}
    moved["model.embed_tokens.weight"][:3] += 0.5  # three rows of one tensor change
    batch = pad_prompts(PROMPTS, "left")
    broadcaster = WeightBroadcaster.connect(backend, host="127.0.0.1", timeout_s=120)
    try:
        broadcaster.refit(weights)
        assert broadcaster.last_size is not None and broadcaster.last_size.deltas == 0
        broadcaster.refit(moved)
        size = broadcaster.last_size
        assert size is not None and size.deltas == len(moved)  # unchanged tensors: 0 changes
        assert size.sent_bytes < size.whole_bytes / 20
        assert broadcaster.sent_bytes() == size.whole_bytes  # the record: one copy
        from_deltas = backend.generate(batch, greedy=True)
        metrics = backend.get_logger_metrics()
        assert metrics["refit_delta_tensors_total"] >= len(moved)
        assert metrics["refit_delta_ratio"] == size.sent_bytes / size.whole_bytes
        assert backend.committed_copy_bytes == size.whole_bytes  # float32: the same bytes
        broadcaster.deltas = False
        broadcaster.refit(weights)
        broadcaster.refit(moved)
        assert broadcaster.last_size is not None and broadcaster.last_size.deltas == 0
        whole = backend.generate(batch, greedy=True)
        assert torch.equal(whole["output_ids"], from_deltas["output_ids"])
        assert torch.equal(whole["logprobs"], from_deltas["logprobs"])
        broadcaster.refit(weights)
    finally:
        broadcaster.close()


def test_the_first_refit_staged_in_an_empty_copy_reaches_the_engine(own, tiny_qwen2):
    """Fails before ``CommittedWeights.staged_items``: the commit loaded the copy's last
    committed tensors, none for the first update, so the engine went on with the checkpoint
    under the new version (hidden where the first refit sent the checkpoint's own weights)."""
    from gen_interface.weights import refit

    generator = torch.Generator().manual_seed(5)
    moved = {
        name: t + 0.3 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in tiny_qwen2.state_dict().items()
    }
    batch = pad_prompts(PROMPTS, "left")
    staged = own.backend(own.cluster([1]), tiny_qwen2, weight_deltas=True, name_prefix="staged")
    plain = own.backend(own.cluster([1]), tiny_qwen2, name_prefix="plain")
    before = staged.generate(batch, greedy=True)
    refit(staged, moved)
    refit(plain, moved)
    after = staged.generate(batch, greedy=True)
    assert not torch.equal(after["logprobs"], before["logprobs"])
    expected = plain.generate(batch, greedy=True)
    assert torch.equal(after["output_ids"], expected["output_ids"])
    assert torch.equal(after["logprobs"], expected["logprobs"])
