"""Delta refits: what changed since the version a backend holds, proven to land bit for bit.

Every backend that claims weight updates runs these. One that also claims deltas
(``claims_weight_deltas``: its ``weight_base()`` answers) must take them exactly: a delta refit
leaves its weights (their checksum, as it reports it) and every later output equal to a whole
refit of the same weights, for sparse and dense changes of any size; and a damaged delta, one on
another base, one that skips a version, and an update that loses a load are each refused, before
anything is written or at the commit, with the old weights in force and the backend usable. One
that does not claim them must answer ``weight_base()`` with None and take a refit with deltas on
as a whole one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from gen_interface import GenerationInterface, WeightBaseError, WeightUpdateError
from gen_interface.weights import (
    Refitter,
    TensorDelta,
    WeightBase,
    bytes_checksum,
    diff_tensors,
    encode_delta,
    named_checksums,
    share_weights,
)
from gen_interface.weights.handles import dtype_from_name
from gen_interface.weights.shm import map_segment
from hypothesis import given, settings
from hypothesis import strategies as st

from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["WeightDeltaProperties"]

#: Examples of the delta property: each runs four refits and four generate calls.
delta_settings = settings(
    property_settings, max_examples=max(3, property_settings.max_examples // 3)
)

#: What the fault checks plant, each refused before a write or at the commit.
DELTA_FAULTS = [
    "damaged on the way",
    "makes another tensor",
    "on an older version",
    "skips a version",
    "on other bytes",
    "a load lost",
]


@st.composite
def weight_changes(draw: st.DrawFn) -> dict[str, Any]:
    """How the trainer's weights moved: a few values (an optimizer step at a small learning
    rate) or most of them, by a little or by a lot."""
    return {
        "sparse": draw(st.booleans(), label="sparse"),
        "share": draw(st.sampled_from([0.001, 0.02, 0.6, 1.0]), label="share"),
        "scale": draw(st.sampled_from([1e-2, 0.3]), label="scale"),
        "seed": draw(st.integers(0, 2**20), label="seed"),
    }


class WeightDeltaProperties(SuiteBase):
    """Delta refits on every backend that claims weight updates (see the module docstring)."""

    # ---- every backend -------------------------------------------------------------------

    def test_a_backend_without_a_base_takes_a_delta_refit_whole(self, subject: ConformanceSubject):
        """``weight_base()`` is None unless deltas are claimed; a refit with deltas on then
        sends every tensor whole and loads what a whole refit loads."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        if self.claims_weight_deltas:
            pytest.skip("backend claims deltas: the delta properties check it")
        original = _weights(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        assert backend.weight_base() is None, "weight_base() answers: claim weight deltas"
        new = _moved(original, {"sparse": True, "share": 0.02, "scale": 0.3, "seed": 1})
        with Refitter(backend, deltas=False, hand_over=False) as whole:
            whole.refit(new)
            expected = _outputs(backend, batch)
            whole.refit(original)
        with Refitter(backend, deltas=True, hand_over=False) as refitter:
            refitter.refit(original)
            refitter.refit(new)
            assert refitter.last_size is not None and refitter.last_size.deltas == 0
            assert refitter.sent_bytes() == 0, "a record was kept for a backend without a base"
        _assert_same_outputs(_outputs(backend, batch), expected)
        _refit_whole(backend, original)

    # ---- backends that take deltas -------------------------------------------------------

    @delta_settings
    @given(change=weight_changes())
    def test_a_delta_refit_equals_a_whole_refit_bit_for_bit(
        self, subject: ConformanceSubject, change: dict[str, Any]
    ):
        """Refitting new weights as deltas gives the weights (the backend's own checksum of
        them, equal to the trainer's) and every later output a whole refit gives; sparse
        changes go as deltas, changes of nearly every value whole."""
        self._require_deltas()
        original = _weights(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        new = _moved(original, change)
        with Refitter(backend, deltas=True, hand_over=False) as refitter:
            refitter.refit(original)
            version = refitter.refit(new)
            size = refitter.last_size
            delta_base = backend.weight_base()
            from_deltas = _outputs(backend, batch)
        assert size is not None and delta_base is not None and delta_base["version"] == version
        assert delta_base["checksum"] == _checksum_as_held(new, delta_base)
        if change["sparse"] and change["share"] <= 0.02:
            assert size.deltas > 0, "a sparse change was sent whole"
            assert size.sent_bytes < size.whole_bytes
        _refit_whole(backend, original)
        with Refitter(backend, deltas=False, hand_over=False) as whole:
            whole_version = whole.refit(new, version=version)
            whole_base = backend.weight_base()
            from_whole = _outputs(backend, batch)
        assert whole_version == version and whole_base == delta_base
        _assert_same_outputs(from_deltas, from_whole)
        _refit_whole(backend, original)

    @pytest.mark.parametrize("fault", DELTA_FAULTS)
    def test_a_bad_delta_is_refused_and_the_old_weights_stay(
        self, subject: ConformanceSubject, fault: str
    ):
        """Each fault is refused (at its load, or at the commit) with the old weights in force:
        same version, same base, same outputs; then a delta refit works."""
        self._require_deltas()
        original = _weights(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        if fault == "damaged on the way" and "shm" not in backend.capabilities.weight_transports:
            pytest.skip("the check damages bytes in shared memory")
        refitter = Refitter(backend, deltas=True, hand_over=False)
        with refitter:
            refitter.refit(original)
            base = backend.weight_base()
            assert base is not None and base["version"] is not None
            version = backend.weight_version
            before = _outputs(backend, batch)
            new = _moved(original, {"sparse": True, "share": 0.05, "scale": 0.3, "seed": 7})
            deltas = _deltas(original, new, base, fault)
            names = list(deltas)
            loads = [dict((n, deltas[n]) for n in names[: len(names) // 2])]
            loads.append({n: deltas[n] for n in names[len(names) // 2 :]})
            if fault == "a load lost":
                loads = loads[:1]
            backend.start_weight_update()
            try:
                with pytest.raises(WeightUpdateError) as refused:
                    for load in loads:
                        with share_weights(load) as shared:
                            if fault == "damaged on the way":
                                _damage_in_place(shared.handles)
                            backend.update_weights_from_ipc_handles(shared.handles)
                    backend.commit_weight_update()
            finally:
                backend.abort_weight_update()
            if fault in ("on an older version", "skips a version", "on other bytes"):
                assert isinstance(refused.value, WeightBaseError), refused.value
            assert backend.weight_version == version
            assert backend.weight_base() == base, "a refused delta changed the base"
            _assert_same_outputs(_outputs(backend, batch), before)
            refitter.refit(new)  # usable: in step with the record again
            assert refitter.last_size is not None and refitter.last_size.deltas > 0
        _refit_whole(backend, original)

    def test_a_backend_whose_base_moved_gets_a_whole_refit_in_the_same_call(
        self, subject: ConformanceSubject
    ):
        """A refitter whose record is not what the backend holds (another trainer refitted it,
        as a restarted server or a new replica would show) sends every tensor whole, commits,
        and is in step again for the next refit."""
        self._require_deltas()
        original = _weights(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        moved = [
            _moved(original, {"sparse": True, "share": 0.01, "scale": 0.3, "seed": s})
            for s in (11, 12, 13)
        ]
        with Refitter(backend, deltas=True, hand_over=False) as refitter:
            refitter.refit(original)
            _refit_whole(backend, moved[0])  # behind the refitter's back
            refitter.refit(moved[1])
            assert refitter.last_size is not None and refitter.last_size.deltas == 0
            after_whole = _outputs(backend, batch)
            refitter.refit(moved[2])
            assert refitter.last_size is not None and refitter.last_size.deltas > 0
        _refit_whole(backend, moved[1])
        _assert_same_outputs(_outputs(backend, batch), after_whole)
        _refit_whole(backend, original)

    def _require_deltas(self) -> None:
        if not self.claims_weight_updates or not self.claims_weight_deltas:
            pytest.skip("backend does not claim weight deltas")


def _weights(subject: ConformanceSubject) -> dict[str, torch.Tensor]:
    if subject.state_dict is None:
        raise AssertionError("claims_weight_updates needs ConformanceSubject.state_dict")
    return {k: v.detach().clone().contiguous() for k, v in subject.state_dict.items()}


def _moved(
    weights: Mapping[str, torch.Tensor], change: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``weights`` with a share of every tensor's values moved (float32 arithmetic: the backend
    casts, as it would a trainer's master weights)."""
    generator = torch.Generator().manual_seed(change["seed"])
    share = change["share"] if change["sparse"] else max(change["share"], 0.6)
    out = {}
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            out[name] = tensor.clone()
            continue
        chosen = torch.rand(tensor.shape, generator=generator) < share
        noise = torch.randn(tensor.shape, generator=generator)
        spread = float(tensor.float().std()) if tensor.numel() > 1 else 1.0
        moved = tensor.float() + change["scale"] * spread * noise * chosen
        out[name] = moved.to(tensor.dtype)
    return out


def _as_held(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor.contiguous()
    return tensor.to(dtype_from_name(dtype)).contiguous()


def _checksum_as_held(weights: Mapping[str, torch.Tensor], base: WeightBase) -> int:
    """The trainer's checksum of ``weights`` cast as the backend holds them."""
    dtypes = base["dtypes"]
    return named_checksums(
        (name, bytes_checksum(_as_held(t, dtypes.get(name)))) for name, t in weights.items()
    )


def _deltas(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    base: WeightBase,
    fault: str,
) -> dict[str, TensorDelta]:
    """Every tensor of ``new`` as a delta against ``old`` as the backend holds it, with
    ``fault`` planted."""
    assert base["version"] is not None
    version = {"on an older version": base["version"] - 1, "skips a version": base["version"] + 1}
    out = {}
    for name, tensor in new.items():
        dtype = base["dtypes"].get(name)
        held, wanted = _as_held(old[name], dtype), _as_held(tensor, dtype)
        against = held
        if fault == "on other bytes" and held.numel():
            against = held.clone()
            against.view(-1)[0] = against.view(-1)[0] + 1
        out[name] = encode_delta(
            diff_tensors(against, wanted),
            wanted.shape,
            wanted.dtype,
            base_version=version.get(fault, base["version"]),
            base_checksum=bytes_checksum(against),
        )
    if fault == "makes another tensor":  # well formed, but not the trainer's tensor
        name = max(out, key=lambda n: out[n].count)
        out[name] = dataclasses.replace(out[name], checksum=out[name].checksum ^ 1)
    return out


def _damage_in_place(handles: Mapping[str, Any]) -> None:
    """Flip a byte of the last delta in shared memory, after its checksum was taken."""
    bucket = handles["buckets"][-1]
    slot = bucket["tensors"][-1]
    data = map_segment(bucket["location"], bucket["nbytes"])
    data[slot["offset"] + slot["nbytes"] - 1] ^= 0xFF


def _outputs(backend: GenerationInterface, batch: Any) -> list[Any]:
    """Greedy and seeded sampled outputs of ``batch``."""
    return [backend.generate(batch, greedy=True), backend.generate(batch, greedy=False)]


def _assert_same_outputs(actual: list[Any], expected: list[Any]) -> None:
    for got, want in zip(actual, expected, strict=True):
        assert torch.equal(got["output_ids"], want["output_ids"]), "tokens differ"
        assert torch.equal(got["logprobs"], want["logprobs"]), "logprobs differ"


def _refit_whole(backend: GenerationInterface, weights: Mapping[str, torch.Tensor]) -> None:
    with Refitter(backend, deltas=False) as whole:
        whole.refit(weights)
