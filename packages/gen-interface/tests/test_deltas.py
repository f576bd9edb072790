"""Deltas (``gen_interface.weights.delta``) and the trainer's record of what a backend holds
(``SentWeights``): bit-exact for every dtype and pattern of change, refused when malformed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gen_interface import WeightUpdateError
from gen_interface.weights import (
    SentWeights,
    TensorDelta,
    apply_delta,
    bytes_checksum,
    diff_tensors,
    encode_delta,
    named_checksums,
    share_weights,
)
from gen_interface.weights.delta import _parts
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(_INT[tensor.element_size()])


@st.composite
def changes(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A base tensor and a new one: a few or most values changed, by a unit in the last place
    (an optimizer step), to a random value, or by random bits (NaNs and infinities included)."""
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    numel = draw(st.sampled_from([0, 1, 7, 255, 256, 257, 4099, 70_000, 140_000]), label="numel")
    shape = (numel,) if numel < 256 or draw(st.booleans()) else (numel // 7, 7)
    numel = int(torch.Size(shape).numel())
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    share = draw(st.sampled_from([0.0, 1e-4, 0.01, 0.3, 0.9, 1.0]), label="share changed")
    how = draw(st.sampled_from(["ulp", "random", "bits"]), label="how")
    generator = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=generator) * 0.03).to(dtype)
    changed = torch.rand(shape, generator=generator) < share
    bits = _bits(base).clone()
    if how == "ulp":
        step = torch.randint(-2, 3, (numel,), generator=generator, dtype=torch.int64)
        moved = bits.to(torch.int64) + step
        bits = torch.where(changed.reshape(-1), moved.to(bits.dtype), bits)
    elif how == "random":
        other = _bits((torch.randn(shape, generator=generator)).to(dtype))
        bits = torch.where(changed.reshape(-1), other, bits)
    else:
        low, high = (-(2**15), 2**15) if bits.dtype == torch.int16 else (-(2**31), 2**31)
        noise = torch.randint(low, high, (numel,), generator=generator, dtype=torch.int64)
        bits = torch.where(changed.reshape(-1), noise.to(bits.dtype), bits)
    return base, bits.view(dtype).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(pair=changes())
def test_a_delta_makes_the_new_tensor_bit_for_bit_and_undoes_itself(pair):
    base, new = pair
    diff = diff_tensors(base, new)
    assert diff.checksum == bytes_checksum(new)
    assert diff.count == int((_bits(base) != _bits(new)).sum())
    delta = encode_delta(
        diff, new.shape, new.dtype, base_version=3, base_checksum=bytes_checksum(base)
    )
    assert delta.nbytes == diff.delta_bytes()
    assert delta.checksum == bytes_checksum(new)
    target = base.clone()
    apply_delta(target, delta)
    assert torch.equal(_bits(target), _bits(new))
    apply_delta(target, delta)
    assert torch.equal(_bits(target), _bits(base))


def test_a_sparse_change_of_bfloat16_costs_about_two_bytes_a_change():
    """One unit in the last place on 1% of the values: the XOR fits one byte, so a change
    costs its offset and that byte, plus the blocks' counts."""
    generator = torch.Generator().manual_seed(0)
    base = (torch.randn(1_000_000, generator=generator) * 0.03).to(torch.bfloat16)
    new = base.clone()
    index = torch.randperm(base.numel(), generator=generator)[:10_000]
    new.view(torch.int16)[index] += 1
    diff = diff_tensors(base, new)
    size = diff.delta_bytes()
    assert diff.count == 10_000
    assert size < 0.02 * base.numel() * 2  # under 2% of the tensor's bytes
    assert size < 2.3 * diff.count + 2 * base.numel() / 256 + 64


@pytest.mark.parametrize(
    "damage", ["count", "block", "planes", "position past the end", "wide index", "encoding"]
)
def test_a_malformed_delta_is_refused_before_anything_is_written(damage):
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(1000, generator=generator)
    new = base.clone()
    new.view(torch.int32)[:200] += 1  # a unit in the last place: one byte of XOR
    new[[500, 999]] += 1.0  # the exponent moves: a wide XOR
    diff = diff_tensors(base, new)
    delta = encode_delta(diff, new.shape, new.dtype, base_version=0, base_checksum=0)
    if damage == "count":
        bad = dataclasses.replace(delta, count=delta.count + 1)
    elif damage == "block":
        bad = dataclasses.replace(delta, block=512)
    elif damage == "planes":
        bad = dataclasses.replace(delta, planes=9)
    elif damage == "position past the end":
        bad = dataclasses.replace(delta, shape=torch.Size([998]))
    elif damage == "wide index":
        assert delta.wide > 0
        bad = dataclasses.replace(delta, payload=delta.payload.clone())
        parts = _parts(bad.payload, 1000, 4, bad.count, bad.block, bad.planes, bad.wide)
        parts.wide_index[0] = bad.count + 5
    else:
        slot = {**delta.describe(), "encoding": "zstd"}
        with pytest.raises(WeightUpdateError, match="encoding"):
            TensorDelta.from_slot(delta.payload, slot, list(new.shape), "float32")
        return
    target = base.clone()
    with pytest.raises(WeightUpdateError, match=r"malformed|cannot apply"):
        apply_delta(target if damage != "position past the end" else target[:998], bad)
    assert torch.equal(target, base)


def test_a_delta_travels_in_a_bucket_and_a_receiver_without_a_base_refuses_it():
    from gen_interface.weights.layout import unpack_entries, unpack_verified
    from gen_interface.weights.shm import map_segment

    base = torch.arange(4096, dtype=torch.float32)
    new = base.clone()
    new[7] = -1.0
    diff = diff_tensors(base, new)
    delta = encode_delta(
        diff, new.shape, new.dtype, base_version=2, base_checksum=bytes_checksum(base)
    )
    with share_weights({"w": delta, "b": torch.ones(3)}) as shared:
        bucket = shared.handles["buckets"][0]
        slot = bucket["tensors"][0]
        assert slot["delta"]["base_version"] == 2 and slot["nbytes"] == delta.nbytes
        data = map_segment(bucket["location"], bucket["nbytes"])
        (slot, got), (_, ones) = list(unpack_entries(data, bucket["tensors"]))
        assert slot["name"] == "w" and isinstance(got, TensorDelta)
        assert torch.equal(ones, torch.ones(3))
        target = base.clone()
        apply_delta(target, got)
        assert torch.equal(target, new)
        with pytest.raises(WeightUpdateError, match="keeps no base"):
            list(unpack_verified(data, bucket["tensors"]))


def test_the_record_sends_whole_then_deltas_and_whole_again_when_out_of_step():
    generator = torch.Generator().manual_seed(2)
    weights = {"a": torch.randn(300, 300, generator=generator), "b": torch.randn(10)}
    base = {"version": None, "checksum": 0, "dtypes": {"a": "bfloat16", "b": "float32"}}
    sent = SentWeights()
    first = list(sent.entries(list(weights.items()), base))
    assert [type(e) for _, e in first] == [torch.Tensor, torch.Tensor]
    assert first[0][1].dtype == torch.bfloat16  # cast to the receiver's dtype
    sent.committed(1)
    checksums = {"a": bytes_checksum(weights["a"].bfloat16()), "b": bytes_checksum(weights["b"])}
    assert sent.checksum() == named_checksums(checksums.items())
    held = {"version": 1, "checksum": sent.checksum(), "dtypes": base["dtypes"]}
    stepped = {"a": weights["a"].clone(), "b": weights["b"] + 1.0}
    stepped["a"][0, :5] += 0.5
    second = dict(sent.entries(list(stepped.items()), held))
    assert isinstance(second["a"], TensorDelta) and second["a"].base_version == 1
    assert isinstance(second["b"], torch.Tensor)  # every value changed: whole is smaller
    assert second["a"].base_checksum == checksums["a"]
    assert second["a"].checksum == bytes_checksum(stepped["a"].bfloat16())
    sent.committed(2)
    stale = {**held, "version": 1}  # the backend did not take version 2
    third = dict(sent.entries(list(stepped.items()), stale))
    assert all(isinstance(e, torch.Tensor) for e in third.values())
