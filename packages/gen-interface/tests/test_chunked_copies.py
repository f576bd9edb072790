"""Copies that hash chunk by chunk: same bytes, same checksums as hashing afterwards, and no
damaged chunk ever written."""

from __future__ import annotations

import pytest
import torch
from gen_backend_kit.weights.consumer import map_bucket, write_shared_weights
from gen_interface import WeightUpdateError
from gen_interface.weights import bytes_checksum, combine_checksums, share_weights
from gen_interface.weights.chunked import (
    CHUNK_BYTES,
    chunk_checksums,
    copy_with_checksums,
    verified_copy,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


@settings(max_examples=20, deadline=None)
@given(nbytes=st.sampled_from([0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, 3 * CHUNK_BYTES + 17]))
def test_a_copy_hashes_what_it_wrote(nbytes: int):
    source = _bytes(nbytes)
    destination = torch.zeros(nbytes, dtype=torch.uint8)
    checksums = copy_with_checksums(destination, source)
    assert torch.equal(destination, source)
    assert checksums == chunk_checksums(source)
    assert len(checksums) == -(-nbytes // CHUNK_BYTES)
    assert combine_checksums(checksums) == bytes_checksum(source)


def test_every_chunk_counts_in_its_place():
    source = _bytes(4 * CHUNK_BYTES + 5)
    before = chunk_checksums(source)
    for index in (0, 2, 4):  # a byte changed in chunk `index` changes that checksum alone
        changed = source.clone()
        changed[index * CHUNK_BYTES] ^= 1
        after = chunk_checksums(changed)
        assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [index]
    swapped = torch.cat([source[CHUNK_BYTES : 2 * CHUNK_BYTES], source[:CHUNK_BYTES]])
    assert bytes_checksum(swapped) != bytes_checksum(source[: 2 * CHUNK_BYTES])


def test_a_damaged_chunk_is_never_written():
    source = _bytes(5 * CHUNK_BYTES + 3)
    expected = chunk_checksums(source)
    source[3 * CHUNK_BYTES + 1] ^= 0xFF  # damaged after its checksum was taken
    destination = torch.zeros_like(source)
    with pytest.raises(WeightUpdateError, match="'w' changed after it was shared"):
        verified_copy(destination, source, expected, "w")
    damaged = slice(3 * CHUNK_BYTES, 4 * CHUNK_BYTES)
    assert not destination[damaged].any()
    # what was written is intact chunks, each equal to its source
    for index in range(6):
        chunk = slice(index * CHUNK_BYTES, (index + 1) * CHUNK_BYTES)
        assert not destination[chunk].any() or torch.equal(destination[chunk], source[chunk])


def test_checksums_of_the_wrong_shape_are_refused():
    source = _bytes(2 * CHUNK_BYTES)
    with pytest.raises(WeightUpdateError, match="malformed"):
        verified_copy(torch.empty_like(source), source, [1], "w")
    with pytest.raises(ValueError, match="cannot copy"):
        copy_with_checksums(torch.empty(3, dtype=torch.uint8), source)


def test_shared_weights_are_written_in_place_verified_and_cast_where_needed():
    weights = {
        "big": torch.randn(3 * CHUNK_BYTES // 4 + 7),  # several chunks, verified chunkwise
        "cast": torch.randn(5, dtype=torch.float64),  # another dtype: verified whole, cast
    }
    targets = {"big": torch.zeros(weights["big"].shape), "cast": torch.zeros(5)}
    with share_weights(weights) as shared:
        assert write_shared_weights(shared.handles, targets) == 2
        assert torch.equal(targets["big"], weights["big"])
        assert torch.equal(targets["cast"], weights["cast"].float())
        bucket = shared.handles["buckets"][0]
        slot = bucket["tensors"][0]
        data = map_bucket(shared.handles, bucket)
        data[slot["offset"] + 2 * CHUNK_BYTES] ^= 1  # the producer writes into a shared bucket
        fresh = {"big": torch.zeros(weights["big"].shape), "cast": torch.zeros(5)}
        with pytest.raises(WeightUpdateError, match="'big' changed"):
            write_shared_weights(shared.handles, fresh)
        third_chunk = fresh["big"].view(torch.uint8)[2 * CHUNK_BYTES :]
        assert not third_chunk.any()
