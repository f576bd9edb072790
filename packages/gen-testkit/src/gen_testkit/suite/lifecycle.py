"""Lifecycle and errors: finish and prepare, bad input, capabilities, async rows."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gen_interface import (
    BackendCapabilities,
    BatchedDataDict,
    GenerationError,
    GenerationInputError,
)
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.bad_inputs import BAD_INPUTS
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["LifecycleProperties"]


class LifecycleProperties(SuiteBase):
    """The lifecycle and error rules of the contract."""

    # ---- lifecycle and errors -----------------------------------------------------------------

    def test_finish_then_prepare_changes_nothing(self, subject: ConformanceSubject):
        """Generate after finish raises GenerationError; after prepare, outputs are unchanged."""
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        backend.finish_generation()
        try:
            with pytest.raises(GenerationError) as refused:
                backend.generate(batch, greedy=True)
            assert not isinstance(refused.value, GenerationInputError)
        finally:
            backend.prepare_for_generation()
        backend.prepare_for_generation()  # idempotent
        self._assert_same(subject, before, backend.generate(batch, greedy=True), "finish, prepare")

    def test_a_row_the_engine_fails_is_an_error_never_a_length_cut_off(
        self, subject: ConformanceSubject
    ):
        """When the engine fails rows, the call raises ``GenerationError`` (not an input error)
        instead of returning them as truncated; afterwards the backend generates as before."""
        if subject.fail_rows is None:
            pytest.skip("the subject offers no way to make its engine fail rows")
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        subject.fail_rows(True)
        try:
            with pytest.raises(GenerationError) as failed:
                out = backend.generate(batch, greedy=True)
                pytest.fail(f"rows the engine failed came back: truncated={out['truncated']}")
        finally:
            subject.fail_rows(False)
        assert not isinstance(failed.value, GenerationInputError)
        self._assert_same(subject, before, backend.generate(batch, greedy=True), "after failure")

    @pytest.mark.parametrize("problem", sorted(BAD_INPUTS))
    def test_bad_input_refused_and_backend_still_usable(
        self, subject: ConformanceSubject, problem: str
    ):
        """Malformed input raises GenerationInputError; the next good call is unaffected."""
        batch = self._fixed_batch(subject)
        before = subject.backend.generate(batch, greedy=True)
        with pytest.raises(GenerationInputError):
            subject.backend.generate(
                BatchedDataDict(BAD_INPUTS[problem](subject.vocab_size)), greedy=False
            )
        after = subject.backend.generate(batch, greedy=True)
        self._assert_same(subject, before, after, f"after refusing input with {problem}")

    def test_capabilities_match_claims(self, subject: ConformanceSubject):
        """``capabilities`` agrees with the claimed flags; unclaimed capabilities raise."""
        caps = subject.backend.capabilities
        assert isinstance(caps, BackendCapabilities)
        assert caps.score == self.claims_score
        assert bool(caps.weight_transports & {"shm", "cuda_ipc"}) == self.claims_weight_updates
        if not self.claims_score:
            with pytest.raises(NotImplementedError, match="score"):
                subject.backend.score(BatchedDataDict())
        if not self.claims_weight_updates:
            with pytest.raises(NotImplementedError, match="update_weights_from_ipc_handles"):
                subject.backend.update_weights_from_ipc_handles({})

    @property_settings
    @given(data=st.data())
    def test_generate_async_yields_every_row(
        self, subject: ConformanceSubject, data: st.DataObject
    ):
        """``generate_async`` yields each row once, equal to that row of ``generate``."""
        drawn = self._draw(data, subject)

        async def collect() -> dict[int, Any]:
            return {i: row async for i, row in subject.backend.generate_async(drawn.data, True)}

        rows = asyncio.run(collect())
        assert sorted(rows) == list(range(len(drawn.prompts)))
        whole = subject.backend.generate(drawn.data, greedy=True)
        for i, row in rows.items():
            self._assert_same(subject, whole.select_indices([i]), row, f"async row {i}")
