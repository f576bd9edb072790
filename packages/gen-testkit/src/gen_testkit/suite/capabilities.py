"""Optional capabilities: ``score`` and weight updates, tested when claimed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from gen_interface import BatchedDataDict, GenerationError, WeightUpdateError
from gen_interface.weights import Refitter, refit, share_tensors, share_weights
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.strategies import DrawnBatch
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings
from gen_testkit.tolerances import tolerance_for

__all__ = ["CapabilityProperties"]


class CapabilityProperties(SuiteBase):
    """``score`` and weight updates, each skipped unless its flag is claimed."""

    # ---- score --------------------------------------------------------------------------------

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_score_matches_generated_logprobs(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Teacher-forced raw logprobs of generated rows equal the raw logprobs reported."""
        if not self.claims_score:
            pytest.skip("backend does not claim score")
        if not greedy and subject.backend.config.get("logprobs_mode") == "processed":
            greedy = True  # sampled rows report processed values, which score does not compute
        drawn = self._draw(data, subject)
        output = subject.backend.generate(drawn.data, greedy=greedy)
        scored = subject.backend.score(_score_input(drawn, output))
        tolerance = tolerance_for(
            subject.backend.config.get("dtype", "float32"), across_backends=False
        )
        diff = (scored - output["logprobs"]).abs().max() if scored.numel() else torch.tensor(0.0)
        assert float(diff) <= tolerance.logprob_atol, f"score differs by {float(diff):.3g}"

    @property_settings
    @given(data=st.data())
    def test_processed_logprobs_are_not_raw(self, subject: ConformanceSubject, data: st.DataObject):
        """In processed mode, sampled logprobs follow the sampling distribution, not the raw one."""
        if not self.claims_score or subject.backend.config.get("logprobs_mode") != "processed":
            pytest.skip("needs score and logprobs_mode='processed'")
        drawn = self._draw(data, subject)
        output = subject.backend.generate(drawn.data, greedy=False)
        raw = subject.backend.score(_score_input(drawn, output))
        generated = output["logprobs"] != 0
        gap = (raw - output["logprobs"])[generated].abs()
        assert float(gap.max()) > 1e-3, "processed logprobs equal the raw ones"

    # ---- weight updates -----------------------------------------------------------------------

    def test_weight_update_changes_outputs_and_restores(self, subject: ConformanceSubject):
        """New weights change greedy outputs; the old weights restore them exactly; the shared
        segments are gone afterwards."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        backend.prepare_refit_info({k: (v.shape, v.dtype) for k, v in original.items()})
        version = backend.weight_version
        with share_weights(_perturbed(original)) as shared:
            backend.update_weights_from_ipc_handles(shared.handles)
            leftover = [
                b["location"] for b in shared.handles["buckets"] if os.path.exists(b["location"])
            ]
        assert not leftover, f"shared-memory segments left after the update: {leftover}"
        assert backend.weight_version == version + 1
        changed = backend.generate(batch, greedy=True)
        assert changed["weight_version"].tolist() == [version + 1] * changed.size
        assert not torch.equal(changed["output_ids"], before["output_ids"]) or not torch.equal(
            changed["logprobs"], before["logprobs"]
        ), "outputs did not change after a weight update"
        with share_weights(original) as shared:
            backend.update_weights_from_ipc_handles(shared.handles)
        after = backend.generate(batch, greedy=True)
        assert torch.equal(after["output_ids"], before["output_ids"])
        assert torch.equal(after["logprobs"], before["logprobs"]), (
            "restoring the weights did not restore the logprobs exactly"
        )

    @pytest.mark.parametrize(
        "fault", ["wrong shape", "unknown name", "non-float dtype", "missing weight"]
    )
    def test_mismatched_weight_update_refused(self, subject: ConformanceSubject, fault: str):
        """An update that does not fit the model, or leaves a weight out, raises
        WeightUpdateError and changes nothing."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        bad = _perturbed(original)
        name = sorted(bad)[-1]
        if fault == "wrong shape":
            bad[name] = torch.cat([bad[name], bad[name][:1]])
        elif fault == "unknown name":
            bad["not.a.weight"] = torch.zeros(3)
        elif fault == "non-float dtype":
            bad[name] = bad[name].to(torch.int32)
        else:
            del bad[name]
        if fault != "missing weight":  # refit info may describe part of the weights
            with pytest.raises(WeightUpdateError):
                backend.prepare_refit_info({k: (v.shape, v.dtype) for k, v in bad.items()})
        version = backend.weight_version
        with share_weights(bad) as shared, pytest.raises(WeightUpdateError):
            backend.update_weights_from_ipc_handles(shared.handles)
        assert backend.weight_version == version
        after = backend.generate(batch, greedy=True)
        assert torch.equal(after["output_ids"], before["output_ids"])
        assert torch.equal(after["logprobs"], before["logprobs"]), (
            "a refused update changed outputs"
        )

    def test_a_streamed_refit_equals_a_one_shot_update(self, subject: ConformanceSubject):
        """``refit`` through buckets smaller than the model (several loads, one transaction)
        gives what one ``update_weights_from_ipc_handles`` gives, and commits its version."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        new = _perturbed(original)
        one_shot = _one_shot_outputs(backend, batch, new, original)
        version = backend.weight_version + 5
        small = max(t.numel() * t.element_size() for t in new.values()) // 2
        streamed_version = refit(backend, new, version=version, bucket_bytes=small, hand_over=False)
        assert streamed_version == version
        _assert_outputs_equal(backend.generate(batch, greedy=True), one_shot, version)
        refit(backend, original)
        assert torch.equal(backend.generate(batch, greedy=True)["logprobs"], before["logprobs"])

    def test_a_refit_handed_over_equals_a_one_shot_update(self, subject: ConformanceSubject):
        """A backend in the trainer's process (``shares_process``) gets the tensors themselves
        from ``Refitter``, in one load and no bucket, and loads exactly what one
        ``update_weights_from_ipc_handles`` loads."""
        if not self.claims_weight_updates or not subject.backend.capabilities.shares_process:
            pytest.skip("backend does not share the trainer's process")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        new = _perturbed(original)
        one_shot = _one_shot_outputs(backend, batch, new, original)
        version = backend.weight_version + 3
        with Refitter(backend) as refitter:
            assert refitter.refit(new, version=version) == version
            assert refitter.allocated_bytes() == 0, "the tensors were copied into buckets"
        _assert_outputs_equal(backend.generate(batch, greedy=True), one_shot, version)
        refit(backend, original)

    def test_a_refit_in_place_equals_a_copied_one(self, subject: ConformanceSubject):
        """Weights that live in shared memory (``share_parameters``) are sent where they are,
        with no bucket, and load exactly as copied ones do."""
        transports = subject.backend.capabilities.weight_transports
        if not self.claims_weight_updates or "shm" not in transports:
            pytest.skip("backend does not take weights through shared memory")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        new = _perturbed(original)
        refit(backend, new)
        copied = backend.generate(batch, greedy=True)
        refit(backend, original)
        in_shm, shared = share_tensors(new)
        with shared, Refitter(backend, hand_over=False) as refitter:
            assert all(t.data_ptr() != new[k].data_ptr() for k, t in in_shm.items())
            refitter.refit(in_shm)
            assert refitter.allocated_bytes() == 0, "tensors in shared memory were copied"
        in_place = backend.generate(batch, greedy=True)
        assert torch.equal(in_place["output_ids"], copied["output_ids"])
        assert torch.equal(in_place["logprobs"], copied["logprobs"])
        refit(backend, original)

    def test_float_weights_in_another_dtype_are_cast(self, subject: ConformanceSubject):
        """float64 master weights load as the model's dtype, exactly as a cast would."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        wide = {k: v.double() if v.is_floating_point() else v for k, v in original.items()}
        refit(backend, wide)
        after = backend.generate(batch, greedy=True)
        assert torch.equal(after["logprobs"], before["logprobs"])

    def test_an_incomplete_transaction_is_refused_and_generation_waits(
        self, subject: ConformanceSubject
    ):
        """A commit with a weight missing raises; generation then refuses (the weights are part
        old, part new) until a complete update commits, which restores the outputs exactly. A
        backend that stages whole updates (``stages_whole_updates``) generates as before."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        original = _state_dict_of(subject)
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        version = backend.weight_version
        backend.start_weight_update()
        part = dict(list(_perturbed(original).items())[:-1])
        with share_weights(part) as shared:
            backend.update_weights_from_ipc_handles(shared.handles)
        with pytest.raises(WeightUpdateError, match="missing"):
            backend.commit_weight_update()
        assert backend.weight_version == version
        if self.stages_whole_updates:  # the served weights were never touched
            assert torch.equal(backend.generate(batch, greedy=True)["logprobs"], before["logprobs"])
            return
        with pytest.raises(GenerationError, match="no real weights"):
            backend.generate(batch, greedy=True)
        refit(backend, original)
        assert torch.equal(backend.generate(batch, greedy=True)["logprobs"], before["logprobs"])

    def test_an_abort_before_any_load_keeps_the_weights(self, subject: ConformanceSubject):
        """start then abort changes nothing: outputs and version stay."""
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        backend, batch = subject.backend, self._fixed_batch(subject)
        before, version = backend.generate(batch, greedy=True), backend.weight_version
        backend.start_weight_update()
        with pytest.raises(WeightUpdateError, match="already in progress"):
            backend.start_weight_update()
        backend.abort_weight_update()
        backend.abort_weight_update()  # a no-op without a transaction
        assert backend.weight_version == version
        assert torch.equal(backend.generate(batch, greedy=True)["logprobs"], before["logprobs"])


def _state_dict_of(subject: ConformanceSubject) -> dict[str, torch.Tensor]:
    if subject.state_dict is None:
        raise AssertionError("claims_weight_updates needs ConformanceSubject.state_dict")
    return {k: v.detach().clone() for k, v in subject.state_dict.items()}


def _one_shot_outputs(
    backend: Any, batch: Any, new: Mapping[str, torch.Tensor], original: Mapping[str, torch.Tensor]
) -> Any:
    """Greedy outputs of ``batch`` with ``new`` loaded in one ``update_weights_from_ipc_handles``;
    ``original`` is refitted back afterwards."""
    with share_weights(new) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    outputs = backend.generate(batch, greedy=True)
    refit(backend, original)
    return outputs


def _assert_outputs_equal(outputs: Any, expected: Any, version: int) -> None:
    """Same tokens and logprobs as ``expected``, every row labelled with ``version``."""
    assert torch.equal(outputs["output_ids"], expected["output_ids"])
    assert torch.equal(outputs["logprobs"], expected["logprobs"])
    assert outputs["weight_version"].tolist() == [version] * outputs.size


def _perturbed(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights plus deterministic noise of a quarter of each tensor's spread."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        spread = tensor.float().std() if tensor.numel() > 1 else torch.tensor(1.0)
        out[name] = tensor + 0.25 * float(spread) * noise
    return out


def _score_input(drawn: DrawnBatch, output: Mapping[str, Any]) -> BatchedDataDict[Any]:
    return BatchedDataDict(
        input_ids=output["output_ids"],
        prompt_lengths=torch.tensor([len(p) for p in drawn.prompts], dtype=torch.int64),
        unpadded_sequence_lengths=output["unpadded_sequence_lengths"],
    )
