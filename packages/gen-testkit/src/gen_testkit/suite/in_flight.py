"""Weight updates while rows run (``capabilities.in_flight_updates``), on any backend.

``"keep"``: running rows pause and go on with the new weights, each token's ``weight_versions``
entry saying which weights produced it. ``"abort"``: running rows end at once with their tokens
so far, marked ``cut_short``, and can be resumed from their prompt plus those tokens. A ``keep``
update dropped after part of it was written ends the rows it paused the same way: their next
token would come from weights that are part old, part new. A healthy update while rows run
commits, whatever those rows do to the numbers a backend's own checks see.

The update has to land while the long rows run. A short call started after them returns once
they have run a few steps, and the update starts then; on a machine slow enough that it still
lands before or after every row ran, the attempt is repeated (at most three times). Not part of
``GenerationConformanceSuite``, since each test generates a few hundred tokens per row:
subclass it once per backend with a ``subject`` fixture whose ``state_dict`` is set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import pytest
import torch
from gen_interface import BatchedDataDict, GenerationInterface, InFlight, WeightsAbsentError
from gen_interface.weights import refit, share_weights

from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject

__all__ = ["InFlightUpdateChecks"]

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7]]


class InFlightUpdateChecks:
    """Both modes of an update that arrives mid-generation. Override ``long_tokens`` for
    models with a context shorter than 512."""

    long_tokens = 400
    #: As ``SuiteBase.stages_whole_updates``.
    stages_whole_updates: ClassVar[bool] = False

    @pytest.fixture(scope="class")
    @classmethod
    def weights(cls, subject: ConformanceSubject) -> tuple[Mapping[str, torch.Tensor], dict]:
        """``(the checkpoint's weights, clearly different ones)``."""
        if not subject.backend.capabilities.in_flight_updates:
            pytest.skip("backend does not claim in-flight weight updates")
        assert subject.state_dict is not None, "the subject needs its state_dict"
        generator = torch.Generator().manual_seed(5)
        new = {
            name: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=generator)
            for name, t in subject.state_dict.items()
        }
        return subject.state_dict, new

    @pytest.fixture
    def long_rows(self, subject: ConformanceSubject, weights: Any) -> Iterator[GenerationInterface]:
        backend = subject.backend
        yield backend.with_sampling(max_new_tokens=self.long_tokens, stop_token_ids=[])
        refit(backend, weights[0])  # the next test starts on the checkpoint's weights

    def test_a_keep_update_midway_changes_the_later_tokens_and_versions_say_where(
        self, subject: ConformanceSubject, long_rows: GenerationInterface, weights: Any
    ) -> None:
        backend = subject.backend
        baseline = long_rows.generate(pad_prompts(PROMPTS, "left"), greedy=True)
        out, old, new = self._midway(backend, long_rows, weights, "keep")
        n = len(PROMPTS)
        assert not out["cut_short"].any()
        assert out["generation_lengths"].tolist() == [self.long_tokens] * n
        assert out["weight_version"].tolist() == [old] * n  # the version each row started on
        changed = 0
        for i in range(n):
            versions = _generated(out, i, "weight_versions")
            assert versions == sorted(versions) and set(versions) <= {old, new}, versions
            switch = versions.index(new) if new in versions else len(versions)
            tokens, before = _generated(out, i), _generated(baseline, i)
            assert tokens[:switch] == before[:switch], f"row {i} changed before the update"
            changed += tokens[switch:] != before[switch:]
        assert changed, "no row's tokens changed after the update"

    def test_an_abort_update_midway_returns_the_rows_so_far_marked_cut_short(
        self, subject: ConformanceSubject, long_rows: GenerationInterface, weights: Any
    ) -> None:
        backend = subject.backend
        baseline = long_rows.generate(pad_prompts(PROMPTS, "left"), greedy=True)
        out, old, new = self._midway(backend, long_rows, weights, "abort")
        cut = out["cut_short"].tolist()
        assert any(cut)
        for i in range(len(PROMPTS)):
            tokens, versions = _generated(out, i), _generated(out, i, "weight_versions")
            assert tokens == _generated(baseline, i)[: len(tokens)], f"row {i}: not a prefix"
            assert set(versions) <= {old}, f"row {i} has tokens of the new weights: {versions}"
            assert cut[i] == (len(tokens) < self.long_tokens), f"row {i}: {len(tokens)} tokens"
            assert not (cut[i] and out["truncated"][i]), f"row {i} is cut short and truncated"
        # The backend goes on, on the new weights; a cut row resumes from prompt + tokens so far.
        row = cut.index(True)
        resumed = long_rows.with_sampling(max_new_tokens=4).generate(
            pad_prompts([PROMPTS[row] + _generated(out, row)], "left"), greedy=True
        )
        assert resumed["weight_version"].tolist() == [new] == [backend.weight_version]
        assert int(resumed["generation_lengths"][0]) == 4

    def test_an_update_dropped_after_a_write_cuts_the_rows_it_paused(
        self, subject: ConformanceSubject, long_rows: GenerationInterface, weights: Any
    ) -> None:
        """``keep`` update, half the new weights written, then an abort: rows it paused end cut
        short with tokens of the old weights only (never one from the mixed weights), and the
        backend generates again once a complete update commits. A backend that stages whole
        updates (``stages_whole_updates``) was never mixed: its rows go on, unchanged."""
        backend = subject.backend
        original, new_weights = weights
        baseline = long_rows.generate(pad_prompts(PROMPTS, "left"), greedy=True)
        half = dict(list(new_weights.items())[: len(new_weights) // 2])

        def write_half_then_abort() -> int:
            backend.start_weight_update(in_flight="keep")
            try:
                with share_weights(half) as shared:
                    backend.update_weights_from_ipc_handles(shared.handles)
            finally:
                backend.abort_weight_update()
            return backend.weight_version

        if self.stages_whole_updates:  # nothing reached the served weights: the rows go on
            old = backend.weight_version
            out, _ = _with_update_midway(backend, long_rows, write_half_then_abort)
            assert not any(out["cut_short"].tolist())
            for i in range(len(PROMPTS)):
                assert _generated(out, i) == _generated(baseline, i), f"row {i} changed"
                assert set(_generated(out, i, "weight_versions")) == {old}
            return
        for _attempt in range(3):
            old = backend.weight_version
            out, _ = _with_update_midway(backend, long_rows, write_half_then_abort)
            with pytest.raises(WeightsAbsentError):
                backend.generate(pad_prompts([[1, 2]], "left"), greedy=True)
            refit(backend, original)
            cut = out["cut_short"].tolist()
            for i in range(len(PROMPTS)):
                tokens, versions = _generated(out, i), _generated(out, i, "weight_versions")
                assert tokens == _generated(baseline, i)[: len(tokens)], (
                    f"row {i} has tokens of the mixed weights: {len(tokens)} tokens, cut={cut[i]}"
                )
                assert set(versions) <= {old}, f"row {i}: versions {set(versions)}"
                assert cut[i] == (len(tokens) < self.long_tokens), f"row {i}: {len(tokens)}"
            if any(cut):
                return
        pytest.fail("the update never landed while the rows ran")

    def _midway(
        self,
        backend: GenerationInterface,
        long_rows: GenerationInterface,
        weights: Any,
        mode: InFlight,
    ) -> tuple[BatchedDataDict[Any], int, int]:
        """Generate the long rows with an update in ``mode`` midway, until it lands while some
        row runs; the output, the version before the update and the one it committed."""
        original, new_weights = weights
        for _attempt in range(3):
            old = backend.weight_version
            out, new = _with_update_midway(
                backend, long_rows, lambda: refit(backend, new_weights, in_flight=mode)
            )
            versions = [_generated(out, i, "weight_versions") for i in range(len(PROMPTS))]
            lengths = out["generation_lengths"].tolist()
            landed = [
                n < self.long_tokens or {old, new} <= set(v) for n, v in zip(lengths, versions)
            ]
            if any(landed):  # not before every row started, nor after every row ended
                return out, old, new
            refit(backend, original)
        pytest.fail("the update never landed while the rows ran")


def _with_update_midway(
    backend: GenerationInterface, long_rows: GenerationInterface, update: Callable[[], int]
) -> tuple[BatchedDataDict[Any], int]:
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(out=long_rows.generate(pad_prompts(PROMPTS, "left"), True))
    )
    worker.start()
    time.sleep(0.3)  # the long rows start first
    backend.with_sampling(max_new_tokens=4).generate(pad_prompts([[1, 2]], "left"), greedy=True)
    version = update()
    worker.join(timeout=600)
    assert "out" in result, "the long rows did not come back"
    return result["out"], version


def _generated(out: BatchedDataDict[Any], i: int, key: str = "output_ids") -> list[int]:
    start = len(PROMPTS[i])
    return out[key][i, start : start + int(out["generation_lengths"][i])].tolist()
