import pytest
import torch
from gen_interface import BatchedDataDict
from hypothesis import given
from hypothesis import strategies as st


def _batch(size: int) -> BatchedDataDict:
    return BatchedDataDict(
        ids=torch.arange(size * 3).reshape(size, 3),
        mask=torch.ones(size, 3, dtype=torch.bool),
        tags=[f"row{i}" for i in range(size)],
    )


def _assert_equal(a: BatchedDataDict, b: BatchedDataDict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert list(a[key]) == list(b[key]), key


@given(size=st.integers(0, 40), shards=st.integers(1, 9))
def test_shard_then_gather_gives_back_the_batch_in_order(size, shards):
    batch = _batch(size)
    parts = batch.shard_by_batch_size(shards, allow_uneven_shards=True)
    assert len(parts) == shards
    sizes = [p.size for p in parts]
    assert sum(sizes) == size and max(sizes) - min(sizes) <= 1
    _assert_equal(BatchedDataDict.from_batches(parts), batch)


@given(chunks=st.integers(1, 5), chunk=st.integers(1, 8), shards=st.integers(1, 4))
def test_shard_with_batch_size_splits_every_chunk(chunks, chunk, shards):
    batch = _batch(chunks * chunk)
    parts = batch.shard_by_batch_size(shards, batch_size=chunk, allow_uneven_shards=True)
    rows = [t for p in parts for t in p["tags"]]
    assert sorted(rows) == sorted(batch["tags"])
    for part in parts:  # each shard takes the same slice of every chunk, in chunk order
        starts = [int(t[3:]) // chunk for t in part["tags"]]
        assert starts == sorted(starts)
        per_chunk = {c: starts.count(c) for c in set(starts)}
        assert len(set(per_chunk.values())) <= 1


def test_uneven_shards_are_refused_unless_allowed():
    with pytest.raises(ValueError, match="allow_uneven_shards"):
        _batch(5).shard_by_batch_size(2)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        _batch(5).shard_by_batch_size(1, batch_size=2)
    with pytest.raises(ValueError, match="shards must be >= 1"):
        _batch(5).shard_by_batch_size(0)


def test_from_batches_pads_each_key_with_its_own_value():
    a = BatchedDataDict(ids=torch.ones(1, 2, dtype=torch.int64), lp=torch.ones(1, 2))
    b = BatchedDataDict(ids=torch.ones(2, 4, dtype=torch.int64), lp=torch.ones(2, 4))
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": 7})
    assert out["ids"].tolist()[0] == [1, 1, 7, 7]
    assert out["lp"].tolist()[0] == [1.0, 1.0, 0.0, 0.0]
    assert out.size == 3
    with pytest.raises(ValueError, match="keys"):
        BatchedDataDict.from_batches([a, BatchedDataDict(ids=torch.ones(1, 2))])


@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=5), drop=st.data())
def test_from_batches_keeps_keys_missing_only_from_empty_batches(sizes, drop):
    batches = []
    for size in sizes:
        batch = _batch(size)
        if size == 0:  # an empty batch: no rows, and maybe not every key (or none)
            kept = drop.draw(st.sets(st.sampled_from(sorted(batch))))
            batch = BatchedDataDict({k: v for k, v in batch.items() if k in kept})
        batches.append(batch)
    out = BatchedDataDict.from_batches(batches)
    assert out.size == sum(sizes)
    filled = [b for b in batches if b.size]
    if filled:  # the reference: the batches with rows, concatenated
        assert set(out) == set(_batch(1))
        assert out["tags"] == [t for b in filled for t in b["tags"]]
        assert torch.equal(out["ids"], torch.cat([b["ids"] for b in filled]))


def test_a_key_missing_from_a_batch_with_rows_is_refused_by_name():
    with pytest.raises(ValueError, match=r"batch 1 has 2 rows but no \['tags'\]"):
        BatchedDataDict.from_batches(
            [_batch(1), BatchedDataDict({k: v for k, v in _batch(2).items() if k != "tags"})]
        )


def test_sizes_that_do_not_divide_are_named():
    with pytest.raises(
        ValueError, match=r"Total batch size \(6\) is not a multiple of batch_size \(4\)"
    ):
        _batch(6).shard_by_batch_size(2, batch_size=4)
    with pytest.raises(ValueError, match=r"Batch size \(3\) is not a multiple of shards \(2\)"):
        _batch(6).shard_by_batch_size(2, batch_size=3)
    with pytest.raises(ValueError, match=r"not the same across the batch's keys.*'b': 3"):
        BatchedDataDict(a=torch.zeros(2), b=[1, 2, 3]).shard_by_batch_size(1)


def test_slice_select_repeat_and_to():
    batch = _batch(4)
    assert batch.slice(1, 3)["tags"] == ["row1", "row2"]
    picked = batch.select_indices([3, 0, 3])
    assert picked["tags"] == ["row3", "row0", "row3"]
    assert picked["ids"][0].tolist() == [9, 10, 11]
    repeated = batch.repeat_interleave(2)
    assert repeated["tags"][:4] == ["row0", "row0", "row1", "row1"]
    assert repeated.size == 8
    moved = batch.to("cpu")
    assert isinstance(moved, BatchedDataDict) and torch.equal(moved["ids"], batch["ids"])


def test_size_refuses_disagreeing_values():
    with pytest.raises(ValueError, match="disagree"):
        _ = BatchedDataDict(a=torch.zeros(2), b=[1, 2, 3]).size
    with pytest.raises(ValueError, match="0-d"):
        _ = BatchedDataDict(a=torch.tensor(1.0)).size
    assert BatchedDataDict().size == 0
