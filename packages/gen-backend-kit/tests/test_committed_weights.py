"""``CommittedWeights``: deltas land bit for bit on the right base only, are undone when the
tensor they make is not the trainer's, and a dropped update is undone as far as it can be."""

from __future__ import annotations

import pytest
import torch
from gen_backend_kit.weights import CommittedWeights
from gen_interface import WeightBaseError, WeightUpdateError
from gen_interface.weights import TensorDelta, bytes_checksum, diff_tensors, encode_delta
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _delta(base: torch.Tensor, new: torch.Tensor, version: int) -> TensorDelta:
    diff = diff_tensors(base, new)
    return encode_delta(
        diff, new.shape, new.dtype, base_version=version, base_checksum=bytes_checksum(base)
    )


def _stepped(tensor: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """``tensor`` with about ``share`` of its values moved by a unit in the last place."""
    generator = torch.Generator().manual_seed(seed)
    out = tensor.clone()
    bits = out.view(torch.int16 if out.element_size() == 2 else torch.int32).reshape(-1)
    chosen = torch.rand(bits.shape, generator=generator) < share
    bits[chosen] += 1
    return out


@pytest.fixture(params=["owned", "views"])
def kind(request):
    return request.param


def _copy_of(weights: dict[str, torch.Tensor], kind: str, version: int = 4) -> CommittedWeights:
    if kind == "views":
        return CommittedWeights.viewing({k: v.clone() for k, v in weights.items()}, version)
    copy = CommittedWeights.owning({k: (v.shape, v.dtype) for k, v in weights.items()})
    copy.begin()
    for name, tensor in weights.items():
        copy.write(name, tensor, bytes_checksum(tensor))
    copy.commit(version)
    return copy


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    share=st.sampled_from([0.0, 0.001, 0.05, 0.7]),
    seed=st.integers(0, 2**20),
    owned=st.booleans(),
)
def test_deltas_make_the_trainers_tensors_and_a_rollback_gives_the_base_back(
    dtype, share, seed, owned
):
    generator = torch.Generator().manual_seed(seed)
    old = {"a": torch.randn(64, 33, generator=generator).to(dtype), "b": torch.randn(7).to(dtype)}
    new = {name: _stepped(t, share, seed + i) for i, (name, t) in enumerate(old.items())}
    copy = _copy_of(old, "owned" if owned else "views")
    before = copy.base()
    copy.begin()
    for name in old:
        copy.apply(name, _delta(old[name], new[name], 4))
    assert all(torch.equal(t, new[n]) for n, t in copy.items())
    assert copy.rollback()
    assert all(torch.equal(t, old[n]) for n, t in copy.items())
    assert copy.base() == before
    copy.begin()
    for name in old:
        copy.apply(name, _delta(old[name], new[name], 4))
    copy.commit(5)
    assert copy.version == 5 and all(torch.equal(t, new[n]) for n, t in copy.items())


@pytest.mark.parametrize("fault", ["older version", "newer version", "other bytes", "no base"])
def test_a_delta_on_another_base_is_refused_before_anything_is_written(kind, fault):
    old = {"w": torch.randn(100)}
    new = {"w": old["w"] + 1.0}
    copy = _copy_of(old, kind)
    if fault == "no base":
        copy.forget() if kind == "owned" else copy.rollback()
        copy.version = None
    delta = _delta(old["w"], new["w"], {"older version": 3, "newer version": 5}.get(fault, 4))
    if fault == "other bytes":
        delta = _delta(old["w"] * 2, new["w"], 4)
    held = [t.clone() for _, t in copy.items()]
    copy.begin()
    with pytest.raises(WeightBaseError):
        copy.apply("w", delta)
    assert all(torch.equal(t, h) for (_, t), h in zip(copy.items(), held))


def test_a_delta_that_makes_another_tensor_is_undone(kind):
    old = {"w": torch.randn(1000)}
    new = {"w": old["w"].clone()}
    new["w"][:10] += 1.0
    delta = _delta(old["w"], new["w"], 4)
    wrong = TensorDelta(**{**delta.__dict__, "checksum": delta.checksum ^ 1})
    copy = _copy_of(old, kind)
    copy.begin()
    with pytest.raises(WeightUpdateError, match="differs from the trainer's"):
        copy.apply("w", wrong)
    assert torch.equal(dict(copy.items())["w"], old["w"])


def test_a_dropped_update_with_a_whole_tensor_leaves_no_base(kind):
    old = {"a": torch.randn(10), "b": torch.randn(10)}
    copy = _copy_of(old, kind)
    copy.begin()
    copy.apply("a", _delta(old["a"], old["a"] + 1, 4))
    copy.write("b", torch.zeros(10))
    assert not copy.rollback()
    assert copy.version is None and copy.base()["version"] is None
    with pytest.raises(WeightBaseError, match="holds no base"):
        copy.apply("a", _delta(old["a"], old["a"] + 1, 4))


def test_an_owned_copy_casts_whole_tensors_and_costs_one_copy():
    copy = CommittedWeights.owning({"w": (torch.Size([8, 8]), torch.bfloat16)})
    assert copy.nbytes == 0 and copy.base()["version"] is None
    copy.begin()
    master = torch.randn(8, 8)
    copy.write("w", master)
    copy.commit(1)
    assert copy.nbytes == 128
    assert torch.equal(dict(copy.items())["w"], master.bfloat16())
    assert copy.base()["dtypes"] == {"w": "bfloat16"}


def test_views_apply_to_tied_weights_once():
    shared = torch.randn(50)
    copy = CommittedWeights.viewing({"embed": shared, "head": shared}, 0)
    new = shared.clone()
    new[3] += 1.0
    delta = _delta(shared.clone(), new, 0)
    copy.begin()
    copy.apply("embed", delta)
    copy.apply("head", delta)  # the same memory: already there
    assert torch.equal(shared, new)
    assert copy.rollback()
    assert not torch.equal(shared, new)


def test_the_staged_tensors_of_the_first_update_of_an_empty_copy_are_what_it_wrote():
    """Fails before ``staged_items``: a backend loaded ``items()`` at the commit, the last
    commit's tensors, which for the first update of an empty owned copy are none, so its
    engine kept the checkpoint while the update committed."""
    specs = {"a": (torch.Size([2]), torch.float32), "b": (torch.Size([3]), torch.float32)}
    copy = CommittedWeights.owning(specs)
    copy.begin()
    copy.write("b", torch.ones(3))
    copy.write("a", torch.zeros(2))
    assert list(copy.items()) == []  # nothing committed yet
    staged = dict(copy.staged_items())
    assert list(staged) == ["b", "a"] and torch.equal(staged["b"], torch.ones(3))
    copy.commit(1)
    copy.begin()
    new_a = torch.full((2,), 2.0)
    copy.apply("a", _delta(dict(copy.items())["a"].clone(), new_a, 1))
    assert [name for name, _ in copy.staged_items()] == ["a"]  # a delta's tensor too
    assert torch.equal(dict(copy.staged_items())["a"], new_a)
