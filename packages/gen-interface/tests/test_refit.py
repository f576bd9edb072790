"""Streaming refits: bounded memory, the transaction around them, and failures midway; and the
hand-over to a backend in the trainer's process, which needs no bucket.

Run against the testkit's n-gram backend (eight tables of 4 MiB), so memory is measured on a
real backend without a model download or an engine. It shares this process, so the streaming
tests ask for buckets (``hand_over=False``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from gen_interface import BackendCapabilities, GenerationError, WeightUpdateError
from gen_interface.weights import Refitter, refit, share_weights
from gen_testkit.conformance import conformance_config
from gen_testkit.ngram import NgramGeneration
from gen_testkit.strategies import pad_prompts

MIB = 2**20
VOCAB, ORDER = 1024, 8  # eight [V, V] float32 tables of 4 MiB: 32 MiB


@pytest.fixture
def backend():
    config = conformance_config(backend="ngram", model_name="ngram", vocab_size=VOCAB)
    backend = NgramGeneration(dict(config, ngram={"vocab_size": VOCAB, "order": ORDER}))
    yield backend
    backend.shutdown()


def new_weights(backend: NgramGeneration, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator) for k, v in backend.state_dict().items()}


def greedy(backend):
    return backend.generate(pad_prompts([[5, 6, 7], [9]], "left"), greedy=True)


class MemoryPeak:
    """Samples, on a thread, this process's private memory (RssAnon) plus the bytes in use in
    the shared-memory file system, and keeps the peak above where it started. (VmHWM would count
    a shared page once per mapping: producer and consumer here share a process.)"""

    def __init__(self):
        self.baseline = self._now()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._now())
            time.sleep(0.0002)

    @staticmethod
    def _now() -> int:
        text = Path("/proc/self/status").read_text()
        anon = int(re.search(r"^RssAnon:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024
        shm = os.statvfs("/dev/shm")
        return anon + (shm.f_blocks - shm.f_bfree) * shm.f_frsize


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /proc and /dev/shm")
def test_a_streamed_refit_holds_about_two_buckets_whatever_the_model_size(backend):
    weights = new_weights(backend)
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    bucket = 4 * MIB  # a table each
    assert model_bytes > 7 * bucket
    with MemoryPeak() as one_shot, share_weights(weights) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    with MemoryPeak() as streamed:
        refit(backend, weights, bucket_bytes=bucket, hand_over=False)
    # One shot: a second full copy of the model. Streamed: two buckets, whatever the model.
    assert one_shot.extra > 0.9 * model_bytes, one_shot.extra
    assert streamed.extra < 2 * bucket + 2 * MIB, streamed.extra
    assert all(torch.equal(backend.state_dict()[k], v) for k, v in weights.items())


def test_a_refit_commits_one_version_over_many_loads(backend):
    weights = new_weights(backend)
    calls = []
    real = backend.update_weights_from_ipc_handles
    backend.update_weights_from_ipc_handles = lambda h: (calls.append(h), real(h))[1]
    assert refit(backend, weights, version=42, bucket_bytes=4 * MIB, hand_over=False) == 42
    assert len(calls) == ORDER + 1  # the bias, then a table per bucket
    assert {h["release_after_read"] for h in calls} == {False}  # the ring reuses its buckets
    assert backend.weight_version == 42 and greedy(backend)["weight_version"].tolist() == [42, 42]


def test_a_refit_that_fails_midway_is_aborted_and_generation_waits(backend):
    before = greedy(backend)
    original = backend.state_dict()
    real = backend.update_weights_from_ipc_handles
    loads = []

    def fail_second(handles):
        loads.append(handles)
        if len(loads) == 2:
            raise WeightUpdateError("the trainer's bucket went missing")
        real(handles)

    backend.update_weights_from_ipc_handles = fail_second
    with pytest.raises(WeightUpdateError, match="went missing"):
        refit(backend, new_weights(backend), bucket_bytes=4 * MIB, hand_over=False)
    backend.update_weights_from_ipc_handles = real
    assert backend.weight_version == 0
    with pytest.raises(GenerationError, match="part old, part new"):
        greedy(backend)  # the first load was written: no sampling from mixed weights
    refit(backend, original)
    assert torch.equal(greedy(backend)["logprobs"], before["logprobs"])


def test_a_refit_refused_at_its_first_load_keeps_the_old_weights(backend):
    before = greedy(backend)
    bad = new_weights(backend)
    bad["tables.1"] = bad["tables.1"][:, :7]
    with pytest.raises(WeightUpdateError, match=r"tables\.1"):
        refit(
            backend,
            {"tables.1": bad.pop("tables.1"), **bad},
            bucket_bytes=4 * MIB,
            hand_over=False,
        )
    assert torch.equal(greedy(backend)["logprobs"], before["logprobs"])


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /proc and /dev/shm")
def test_a_backend_in_this_process_is_handed_the_tensors_in_one_load(backend):
    """No bucket, no shared memory, no load through handles: one in-process load of the
    transaction, its version committed and the weights equal to the trainer's."""
    assert backend.capabilities.shares_process
    weights = new_weights(backend)
    handed, real = [], backend.update_weights_from_state_dict
    backend.update_weights_from_state_dict = lambda sd: (handed.append(sd), real(sd))[1]
    backend.update_weights_from_ipc_handles = lambda h: pytest.fail("a bucket was loaded")
    with MemoryPeak() as peak, Refitter(backend) as refitter:
        assert refitter.refit(weights, version=7) == 7
        assert refitter.allocated_bytes() == 0
    assert len(handed) == 1  # the trainer's own tensors, not copies:
    assert all(handed[0][k].data_ptr() == v.data_ptr() for k, v in weights.items())
    assert peak.extra < 2 * MIB, peak.extra  # the tables were written where they are
    assert backend.weight_version == 7 and greedy(backend)["weight_version"].tolist() == [7, 7]
    assert all(torch.equal(backend.state_dict()[k], v) for k, v in weights.items())


def test_a_refused_hand_over_is_aborted_and_keeps_the_old_weights(backend):
    before = greedy(backend)
    bad = new_weights(backend)
    bad["tables.1"] = bad["tables.1"][:, :7]
    with pytest.raises(WeightUpdateError, match=r"tables\.1"):
        refit(backend, bad, version=3)
    assert backend.weight_version == 0
    assert torch.equal(greedy(backend)["logprobs"], before["logprobs"])
    assert refit(backend, new_weights(backend), version=3) == 3  # the backend takes the next


def test_a_hand_over_is_refused_up_front_where_the_backend_takes_no_state_dict():
    class ElsewhereBackend:  # what Refitter reads of a backend in another process
        capabilities = BackendCapabilities(weight_transports=frozenset({"shm"}))

    with pytest.raises(ValueError, match="takes no in-process state dict"):
        Refitter(ElsewhereBackend(), hand_over=True)  # type: ignore[arg-type]
    assert not Refitter(ElsewhereBackend()).hands_over  # type: ignore[arg-type]
