"""``weights.relay``: shared buckets carried to another machine arrive as handles that a load
reads and verifies exactly as the producer's own, and anything changed or lost on the way is
caught there, with nothing left behind."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gen_backend_kit.weights import read_shared_weights, release_shared_weights
from gen_backend_kit.weights.relay import bucket_bytes, rehosted_bucket, rehosted_handles
from gen_interface import WeightUpdateError
from gen_interface.weights import share_weights

WEIGHTS = {
    "embed.weight": torch.arange(600, dtype=torch.float32).reshape(20, 30) / 7,
    "norm.weight": torch.linspace(-1, 1, 64, dtype=torch.bfloat16),
    "head.weight": torch.randn(40, 16, generator=torch.Generator().manual_seed(3)),
}


@pytest.fixture
def shared():
    with share_weights(WEIGHTS, bucket_bytes=2048) as weights:  # several buckets
        assert len(weights.handles["buckets"]) > 1
        yield weights.handles


def _relay(handles, damage=None):
    """The handles as the reader's machine gets them; ``damage(index, bytes)`` may change a
    bucket on the way."""
    buckets = []
    for index, bucket in enumerate(handles["buckets"]):
        data = bucket_bytes(handles, index)
        if damage is not None:
            data = damage(index, data)
        buckets.append(rehosted_bucket(bucket, data))
    return rehosted_handles(buckets)


def test_relayed_buckets_give_back_every_tensor_bit_for_bit(shared) -> None:
    relayed = _relay(shared)
    try:
        producer = {b["location"] for b in shared["buckets"]}
        assert not producer & {b["location"] for b in relayed["buckets"]}  # segments of its own
        got = dict(read_shared_weights(relayed))
        assert list(got) == list(WEIGHTS)
        for name, tensor in WEIGHTS.items():
            assert got[name].dtype == tensor.dtype
            assert torch.equal(got[name], tensor)
    finally:
        assert release_shared_weights(relayed) == len(relayed["buckets"])
    assert not any(os.path.exists(b["location"]) for b in relayed["buckets"])


def test_a_byte_changed_on_the_way_is_caught_by_the_load(shared) -> None:
    def flip(index: int, data: np.ndarray) -> np.ndarray:
        if index == 1:
            data = data.copy()
            data[0] ^= 0xFF
        return data

    relayed = _relay(shared, flip)
    try:
        with pytest.raises(WeightUpdateError, match=r"checksum|changed"):
            read_shared_weights(relayed)
    finally:
        release_shared_weights(relayed)


def test_a_bucket_of_the_wrong_size_is_refused_and_leaves_nothing(shared) -> None:
    bucket = shared["buckets"][0]
    data = bucket_bytes(shared, 0)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with pytest.raises(WeightUpdateError, match="lost or added bytes"):
        rehosted_bucket(bucket, data[:-1])
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after <= before


def test_only_existing_shared_memory_buckets_are_read(shared) -> None:
    with pytest.raises(WeightUpdateError, match="asked of weight handles"):
        bucket_bytes(shared, len(shared["buckets"]))
    cuda = {**shared, "buckets": [{**shared["buckets"][0], "transport": "cuda_ipc"}]}
    with pytest.raises(WeightUpdateError, match="only shared-memory buckets"):
        bucket_bytes(cuda, 0)
