"""NeMo RL's ``BatchedDataDict`` methods, checked against plain list-of-rows references.

A batch is compared through its rows (``row[i][key]`` is ``value[i].tolist()`` for a tensor, the
item for a list) and its schema (each tensor's dtype and trailing shape), so the references below
are ordinary list slicing and never call the code under test.
"""

import pickle
import random
import runpy
import socket
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gen_interface import BatchedDataDict
from hypothesis import given, settings
from hypothesis import strategies as st

Rows = list[dict[str, Any]]
Schema = dict[str, tuple[Any, ...]]

_FAST = settings(deadline=None, max_examples=60)


@st.composite
def batches(draw: st.DrawFn, size: int | None = None) -> BatchedDataDict:
    """1-4 keys over ``size`` rows: int64 / float32 tensors of 1-3 dims, or lists."""
    b = draw(st.integers(0, 10)) if size is None else size
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    out: dict[str, Any] = {}
    for k in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["int64", "float32", "list"]))
        if kind == "list":
            item = st.one_of(st.integers(-5, 5), st.text(max_size=3))
            out[f"k{k}"] = draw(st.lists(item, min_size=b, max_size=b))
            continue
        shape = (b, *draw(st.lists(st.integers(0, 3), max_size=2)))
        if kind == "int64":
            out[f"k{k}"] = torch.randint(-100, 100, shape, generator=gen)
        else:
            out[f"k{k}"] = torch.randn(shape, generator=gen)
    return BatchedDataDict(out)


def _rows(batch: BatchedDataDict) -> Rows:
    return [
        {k: v[i].tolist() if isinstance(v, torch.Tensor) else v[i] for k, v in batch.items()}
        for i in range(batch.size)
    ]


def _schema(batch: BatchedDataDict) -> Schema:
    return {
        k: (v.dtype, tuple(v.shape[1:])) if isinstance(v, torch.Tensor) else ("list",)
        for k, v in batch.items()
    }


def _assert_is(batch: BatchedDataDict, rows: Rows, schema: Schema) -> None:
    """``batch`` holds exactly ``rows`` with ``schema``'s keys (in order), dtypes and shapes."""
    assert isinstance(batch, BatchedDataDict)
    assert list(batch) == list(schema)
    assert _schema(batch) == schema
    assert batch.size == len(rows)
    assert _rows(batch) == rows


def _concat(parts: list[BatchedDataDict]) -> Rows:
    return [row for part in parts for row in _rows(part)]


# chunk


@_FAST
@given(st.data(), st.integers(1, 5), st.integers(0, 4))
def test_chunk_is_the_rank_th_contiguous_run_and_a_copy(data, chunks, per_chunk):
    batch = data.draw(batches(size=chunks * per_chunk))
    rank = data.draw(st.integers(0, chunks - 1))
    rows, schema = _rows(batch), _schema(batch)
    part = batch.chunk(rank, chunks)
    _assert_is(part, rows[rank * per_chunk : (rank + 1) * per_chunk], schema)
    all_parts = [batch.chunk(r, chunks) for r in range(chunks)]
    assert _concat(all_parts) == rows
    for value in part.values():  # writing into the chunk leaves the batch alone
        if isinstance(value, torch.Tensor):
            value.add_(1)
        else:
            value.append("extra")
    assert _rows(batch) == rows and batch.size == chunks * per_chunk


def test_chunk_accepts_every_rank_below_chunks():
    # NeMo RL's `B // chunks > rank` refuses rank 1 of 4 chunks of a 4-row batch.
    batch = BatchedDataDict(x=torch.arange(4), t=["a", "b", "c", "d"])
    assert [batch.chunk(r, 4)["t"] for r in range(4)] == [["a"], ["b"], ["c"], ["d"]]


@given(batches(), st.integers(-3, 8), st.integers(-2, 6))
@_FAST
def test_chunk_refuses_bad_arguments(batch, rank, chunks):
    valid = chunks >= 1 and 0 <= rank < chunks and batch.size % chunks == 0
    if valid:
        assert batch.chunk(rank, chunks).size == batch.size // chunks
    else:
        with pytest.raises(ValueError):
            batch.chunk(rank, chunks)


# reorder_data


@_FAST
@given(st.data(), st.booleans())
def test_reorder_data_moves_row_i_to_position_indices_i(data, as_tensor):
    batch = data.draw(batches())
    perm = data.draw(st.permutations(range(batch.size)))
    rows, schema = _rows(batch), _schema(batch)
    expected: Rows = [{} for _ in rows]
    for i, j in enumerate(perm):
        expected[j] = rows[i]
    indices = torch.tensor(perm, dtype=torch.long) if as_tensor else perm
    assert batch.reorder_data(indices) is None
    _assert_is(batch, expected, schema)


@_FAST
@given(st.data())
def test_reorder_data_undoes_select_indices_with_the_same_permutation(data):
    batch = data.draw(batches())
    perm = data.draw(st.permutations(range(batch.size)))
    gathered = batch.select_indices(perm)
    gathered.reorder_data(perm)
    _assert_is(gathered, _rows(batch), _schema(batch))


@_FAST
@given(st.data())
def test_reorder_data_refuses_non_permutations_and_changes_nothing(data):
    batch = data.draw(batches())
    bad = data.draw(
        st.lists(st.integers(-2, batch.size + 2), max_size=batch.size + 2).filter(
            lambda xs: sorted(xs) != list(range(batch.size))
        )
    )
    rows = _rows(batch)
    with pytest.raises(ValueError, match="permutation"):
        batch.reorder_data(bad)
    assert _rows(batch) == rows


# get_batch


@_FAST
@given(st.data(), st.integers(1, 4), st.integers(0, 4))
def test_get_batch_is_the_batch_idx_th_run_of_batch_size_rows(data, batch_size, n_batches):
    extra = data.draw(st.integers(0, batch_size - 1))  # a short tail is never a batch
    batch = data.draw(batches(size=batch_size * n_batches + extra))
    rows, schema = _rows(batch), _schema(batch)
    for idx in range(n_batches):
        got = batch.get_batch(idx, batch_size)
        _assert_is(got, rows[idx * batch_size : (idx + 1) * batch_size], schema)
    for idx in (-1, n_batches):
        with pytest.raises(ValueError, match="out of range"):
            batch.get_batch(idx, batch_size)


@pytest.mark.parametrize("batch_size", [None, 0, -1])
def test_get_batch_needs_a_positive_batch_size(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        BatchedDataDict(x=torch.zeros(4, 2)).get_batch(0, batch_size)


# truncate_tensors


def _truncated(value: Any, dim: int, n: int) -> Any:
    return value[:n] if dim == 0 else [_truncated(v, dim - 1, n) for v in value]


@_FAST
@given(st.data(), st.integers(0, 3))
def test_truncate_tensors_narrows_tensors_with_more_than_dim_dims(data, dim):
    batch = data.draw(batches())
    before = dict(batch)
    targets = [k for k, v in before.items() if isinstance(v, torch.Tensor) and v.dim() > dim]
    limit = min((before[k].shape[dim] for k in targets), default=3)
    n = data.draw(st.integers(0, limit))
    batch.truncate_tensors(dim, n)
    assert list(batch) == list(before)
    for key, old in before.items():
        new = batch[key]
        if key not in targets:
            assert new is old  # lists and tensors with too few dims are untouched
            continue
        shape = list(old.shape)
        shape[dim] = n
        assert list(new.shape) == shape and new.dtype == old.dtype
        assert new.tolist() == _truncated(old.tolist(), dim, n)


@_FAST
@given(st.data())
def test_truncate_tensors_refuses_a_length_past_the_end_and_changes_nothing(data):
    batch = data.draw(batches())
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 1}
    if tensors:
        too_long = max(v.shape[1] for v in tensors.values()) + 1
        with pytest.raises(ValueError, match="cannot truncate"):
            batch.truncate_tensors(1, too_long)
        assert all(batch[k] is v for k, v in tensors.items())
    for dim, n in ((-1, 0), (0, -1)):
        with pytest.raises(ValueError, match=">= 0"):
            batch.truncate_tensors(dim, n)


# make_microbatch_iterator


@_FAST
@given(st.data(), st.integers(1, 4), st.integers(0, 4))
def test_microbatches_are_consecutive_slices_covering_the_batch(data, mbs, count):
    batch = data.draw(batches(size=mbs * count))
    rows, schema = _rows(batch), _schema(batch)
    micro = list(batch.make_microbatch_iterator(mbs))
    assert len(micro) == count
    for i, mb in enumerate(micro):
        _assert_is(mb, rows[i * mbs : (i + 1) * mbs], schema)


@_FAST
@given(batches(), st.integers(-1, 6))
def test_microbatch_iterator_refuses_a_size_that_does_not_divide_b_when_called(batch, mbs):
    if mbs >= 1 and batch.size % mbs == 0:
        assert sum(mb.size for mb in batch.make_microbatch_iterator(mbs)) == batch.size
    else:
        with pytest.raises(ValueError, match="multiple of microbatch_size"):
            batch.make_microbatch_iterator(mbs)  # not deferred to the first next()


# get_dict


@_FAST
@given(batches())
def test_get_dict_is_a_shallow_plain_copy(batch):
    plain = batch.get_dict()
    assert type(plain) is dict and plain == dict(batch)
    assert all(plain[k] is v for k, v in batch.items())
    plain["new"] = [1]
    assert "new" not in batch


# all_gather, between real gloo processes

_WORLD = 3
# One case: (per-rank batches, the ranks in the group or None for the whole world).
Case = tuple[list[dict[str, Any]], list[int] | None]


def _random_cases(seed: int, count: int) -> list[Case]:
    """Per-rank batches of sizes 0-4 that agree on keys, dtypes and trailing dims."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for _ in range(count):
        sizes = [rng.randint(0, 4) for _ in range(_WORLD)]
        makers: dict[str, Callable[[int], Any]] = {}
        for k in range(rng.randint(1, 4)):
            trailing = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
            kind = rng.choice(["int64", "float32", "bool", "list"])
            if kind == "list":
                makers[f"k{k}"] = lambda n: [rng.choice(["a", 1, (2, "b"), None]) for _ in range(n)]
            elif kind == "int64":
                makers[f"k{k}"] = lambda n, s=trailing: torch.randint(-9, 9, (n, *s))
            elif kind == "float32":
                makers[f"k{k}"] = lambda n, s=trailing: torch.randn(n, *s)
            else:
                makers[f"k{k}"] = lambda n, s=trailing: torch.rand(n, *s) > 0.5
        cases.append(([{k: make(n) for k, make in makers.items()} for n in sizes], None))
    return cases


def _error_cases() -> list[Case]:
    ok = {"x": torch.zeros(1, 2), "t": ["a"]}
    return [
        ([ok, {**ok, "extra": [1]}, ok], None),  # keys differ
        ([ok, {"x": torch.zeros(2, 3), "t": ["a", "b"]}, ok], None),  # trailing dims differ
        ([ok, {"x": torch.zeros(1, 2, dtype=torch.int64), "t": ["a"]}, ok], None),  # dtype
        ([ok, {**ok, "x": 3}, ok], None),  # not a tensor or a list
        ([ok, {"x": ["a"], "t": ["a"]}, ok], None),  # tensor here, list there
        ([{"x": torch.tensor(1.0)}] * _WORLD, None),  # 0-d
    ]


def _gloo_worker(rank: int, port: int, payload: bytes, results: Any) -> None:
    cases: list[Case] = pickle.loads(payload)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=_WORLD
    )
    try:
        subgroup = dist.new_group([0, _WORLD - 1])  # every rank must create it
        out: list[tuple[str, Any]] = []
        for per_rank, members in cases:
            if members is not None and rank not in members:
                out.append(("skipped", None))
                continue
            group = None if members is None else subgroup
            try:
                out.append(("ok", dict(BatchedDataDict(per_rank[rank]).all_gather(group))))
            except (TypeError, ValueError) as exc:
                out.append((type(exc).__name__, str(exc)))
        results.put((rank, pickle.dumps(out)))
    finally:
        dist.destroy_process_group()


if __name__ == "__gloo_worker__":  # a spawned rank, started through runpy.run_path below
    _gloo_worker(**globals()["_WORKER_ARGS"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_gloo(cases: list[Case]) -> list[list[tuple[str, Any]]]:
    """Each rank's outcome of every case, indexed ``[rank][case]``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, payload = _free_port(), pickle.dumps(cases)
    # runpy: pytest's importlib mode gives this module a name a spawned child cannot import.
    procs = [
        ctx.Process(
            target=runpy.run_path,
            args=(__file__,),
            kwargs={
                "run_name": "__gloo_worker__",
                "init_globals": {
                    "_WORKER_ARGS": dict(rank=r, port=port, payload=payload, results=results)
                },
            },
        )
        for r in range(_WORLD)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [pickle.loads(got[r]) for r in range(_WORLD)]


def _expected(per_rank: list[dict[str, Any]], ranks: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in per_rank[0]:
        values = [per_rank[r][key] for r in ranks]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.cat(values)
        else:
            out[key] = [item for v in values for item in v]
    return out


def test_all_gather_concatenates_jagged_ranks_in_rank_order_over_gloo():
    cases = _random_cases(seed=0, count=20)
    uneven = {"ids": [torch.arange(6).reshape(3, 2), torch.empty(0, 2, dtype=torch.int64),
                      torch.arange(2).reshape(1, 2)],
              "t": [["a", "b", "c"], [], ["z"]]}  # fmt: skip
    subgroup_case = [{k: v[r] for k, v in uneven.items()} for r in range(_WORLD)]
    cases += [(subgroup_case, None), (subgroup_case, [0, _WORLD - 1])]
    cases += [([{"x": torch.zeros(0, 5)}] * _WORLD, None)]  # every rank empty
    ab = {"a": torch.ones(2, 3), "b": torch.arange(4).reshape(2, 2)}
    cases += [([ab, dict(reversed(ab.items())), ab], None)]  # rank 1 lists its keys backwards
    cases += _error_cases()
    outcomes = _run_gloo(cases)

    n_ok = len(cases) - len(_error_cases())
    for c, (per_rank, members) in enumerate(cases[:n_ok]):
        ranks = list(range(_WORLD)) if members is None else members
        want = _expected(per_rank, ranks)
        for r in ranks:
            status, got = outcomes[r][c]
            assert status == "ok", (c, r, got)
            assert list(got) == list(want)
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert got[key].dtype == value.dtype and got[key].shape == value.shape
                    assert torch.equal(got[key], value), (c, r, key)
                else:
                    assert got[key] == value, (c, r, key)
    assert all(outcomes[1][c][0] == "skipped" for c in range(n_ok) if cases[c][1] is not None)

    expected_errors = ["ValueError", "ValueError", "ValueError", "TypeError", "ValueError",
                       "ValueError"]  # fmt: skip
    for c, want_error in enumerate(expected_errors, start=n_ok):
        statuses = {outcomes[r][c][0] for r in range(_WORLD)}
        assert statuses == {want_error}, (c, [outcomes[r][c] for r in range(_WORLD)])
