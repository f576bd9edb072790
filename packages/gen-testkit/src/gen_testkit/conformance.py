"""The CONTRACT as a test base class that every backend's test file subclasses.

Usage, in a backend's tests::

    class TestMyBackend(GenerationConformanceSuite):
        claims_score = True

        @pytest.fixture(scope="class")
        @classmethod
        def subject(cls, tiny_qwen2):
            config = conformance_config(backend="mine", model_name=str(tiny_qwen2.path),
                                        vocab_size=tiny_qwen2.vocab_size)
            backend = MyBackend(config)
            yield ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())
            backend.shutdown()

The subject's backend must be built from ``conformance_config`` (other keys may be added): the
properties rely on its short generations and its many stop tokens. Capability flags
(``claims_*``) turn on the tests of optional capabilities; a capability not claimed must raise
``NotImplementedError``. Override a test only with a reason in its docstring.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from gen_interface import (
    BackendCapabilities,
    BatchedDataDict,
    GenerationError,
    GenerationInputError,
    GenerationInterface,
    WeightUpdateError,
)
from gen_interface.weights import share_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gen_testkit.bad_inputs import BAD_INPUTS
from gen_testkit.compare import compare_generations
from gen_testkit.properties import (
    check_layout,
    check_lengths,
    check_logprob_range,
    check_padding,
    check_prompt_kept,
    check_stop_rules,
)
from gen_testkit.strategies import PADDINGS, DrawnBatch, generation_batches, pad_prompts, prompts
from gen_testkit.tolerances import tolerance_for

__all__ = ["ConformanceSubject", "GenerationConformanceSuite", "conformance_config"]

#: A fixed batch used where a test needs the same input twice.
FIXED_PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7, 7, 7, 7], [300, 12]]


def conformance_config(
    *,
    backend: str,
    model_name: str,
    vocab_size: int,
    pad_token_id: int = 0,
    logprobs_mode: str = "raw",
    **extra: Any,
) -> dict[str, Any]:
    """The config a conformance subject is built from.

    Eight new tokens and a stop token every 13 ids: with a random model about half the rows stop
    early and half run to the limit, so both paths are exercised by every batch.
    """
    return {
        "backend": backend,
        "model_name": model_name,
        "max_new_tokens": 8,
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "stop_token_ids": list(range(3, vocab_size, 13)),
        "stop_strings": None,
        "pad_token_id": pad_token_id,
        "logprobs_mode": logprobs_mode,
        "seed": 1234,
        "dtype": "float32",
        "colocated": {"enabled": False},
        **extra,
    }


@dataclass(repr=False)
class ConformanceSubject:
    """A backend under test and what the suite needs to know about its model.

    Attributes:
        backend: built from ``conformance_config``.
        vocab_size: the model's vocabulary size.
        state_dict: the model's weights by checkpoint name, for the weight-update tests.
    """

    backend: GenerationInterface
    vocab_size: int
    state_dict: Mapping[str, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"ConformanceSubject({type(self.backend).__name__}, vocab_size={self.vocab_size})"


def _examples() -> int:
    """Examples per property: half the active hypothesis profile's, at least 3."""
    return max(3, settings().max_examples // 2)


_property = settings(
    max_examples=_examples(),
    deadline=None,
    # the same property runs for every backend class that inherits it
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.differing_executors,
    ],
)


class GenerationConformanceSuite:
    """The CONTRACT's generation rules, as tests a backend's test class inherits.

    Subclasses provide the class-scoped ``subject`` fixture and set the flags below.
    """

    #: ``update_weights_from_ipc_handles`` and ``prepare_refit_info`` work (needs a state dict).
    claims_weight_updates: ClassVar[bool] = False
    #: ``score`` works.
    claims_score: ClassVar[bool] = False
    #: Largest batch and prompt the properties draw.
    max_rows: ClassVar[int] = 6
    max_prompt_length: ClassVar[int] = 12

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[ConformanceSubject]:
        """Override in the subclass: build the backend from ``conformance_config``."""
        raise NotImplementedError(f"{cls.__name__} must override the subject fixture")
        yield  # pragma: no cover

    # ---- helpers -------------------------------------------------------------------------

    def _draw(self, data: st.DataObject, subject: ConformanceSubject, **kwargs: Any) -> DrawnBatch:
        return data.draw(
            generation_batches(
                subject.vocab_size,
                max_rows=kwargs.pop("max_rows", self.max_rows),
                max_length=self.max_prompt_length,
                pad_token_id=subject.backend.config["pad_token_id"],
                **kwargs,
            ),
            label="batch",
        )

    def _assert_same(
        self, subject: ConformanceSubject, expected: Any, actual: Any, what: str
    ) -> None:
        config = subject.backend.config
        tolerance = tolerance_for(config.get("dtype", "float32"), across_backends=False)
        atol = (
            tolerance.processed_logprob_atol
            if config.get("logprobs_mode") == "processed"
            else tolerance.logprob_atol
        )
        compare_generations(
            expected, actual, logprob_atol=atol, near_tie=tolerance.near_tie
        ).assert_ok(what)

    def _fixed_batch(self, subject: ConformanceSubject) -> BatchedDataDict[Any]:
        rows = [[t % subject.vocab_size for t in row] for row in FIXED_PROMPTS]
        return pad_prompts(rows, "left", pad_token_id=subject.backend.config["pad_token_id"])

    # ---- the output layout ---------------------------------------------------------------

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_output_layout(self, subject: ConformanceSubject, data: st.DataObject, greedy: bool):
        """Every field present, with its dtype and shape; L = max(p + g); unpadded = p + g."""
        drawn = self._draw(data, subject)
        check_layout(drawn.prompts, subject.backend.generate(drawn.data, greedy=greedy))

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_prompt_kept(self, subject: ConformanceSubject, data: st.DataObject, greedy: bool):
        """Each output row starts with its unpadded prompt, whatever the input padding."""
        drawn = self._draw(data, subject)
        check_prompt_kept(drawn.prompts, subject.backend.generate(drawn.data, greedy=greedy))

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_padding_and_zero_logprobs(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """pad_token_id after each row's end; logprobs 0.0 outside generated positions."""
        drawn = self._draw(data, subject)
        output = subject.backend.generate(drawn.data, greedy=greedy)
        check_padding(drawn.prompts, output, subject.backend.config["pad_token_id"])

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_lengths_within_limits(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Every row generates between 1 and max_new_tokens tokens."""
        drawn = self._draw(data, subject)
        output = subject.backend.generate(drawn.data, greedy=greedy)
        check_lengths(output, subject.backend.config["max_new_tokens"])

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_stop_tokens(self, subject: ConformanceSubject, data: st.DataObject, greedy: bool):
        """A row ends right after its first stop token (kept), else runs to max_new_tokens."""
        drawn = self._draw(data, subject)
        config = subject.backend.config
        check_stop_rules(
            drawn.prompts,
            subject.backend.generate(drawn.data, greedy=greedy),
            config.get("stop_token_ids") or [],
            config["max_new_tokens"],
        )

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_logprobs_in_range(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Generated positions hold finite log-probabilities <= 0."""
        drawn = self._draw(data, subject)
        check_logprob_range(drawn.prompts, subject.backend.generate(drawn.data, greedy=greedy))

    def test_empty_batch(self, subject: ConformanceSubject):
        """B = 0 gives every output field, empty, with its dtype."""
        empty: BatchedDataDict[Any] = BatchedDataDict(
            input_ids=torch.zeros((0, 5), dtype=torch.int64),
            attention_mask=torch.zeros((0, 5), dtype=torch.int64),
        )
        for greedy in (True, False):
            output = subject.backend.generate(empty, greedy=greedy)
            check_layout([], output)
            assert output["output_ids"].shape[0] == 0

    # ---- determinism and independence ------------------------------------------------------

    @_property
    @given(data=st.data())
    def test_greedy_repeatable(self, subject: ConformanceSubject, data: st.DataObject):
        """The same greedy call twice gives the same output."""
        drawn = self._draw(data, subject)
        first = subject.backend.generate(drawn.data, greedy=True)
        second = subject.backend.generate(drawn.data, greedy=True)
        self._assert_same(subject, first, second, "two identical greedy calls")

    @_property
    @given(data=st.data())
    def test_seeded_sampling_repeatable(self, subject: ConformanceSubject, data: st.DataObject):
        """With a config seed, the same sampled call twice gives the same output."""
        drawn = self._draw(data, subject)
        first = subject.backend.generate(drawn.data, greedy=False)
        second = subject.backend.generate(drawn.data, greedy=False)
        self._assert_same(subject, first, second, "two identical seeded sampling calls")

    @_property
    @given(data=st.data())
    def test_rows_sharing_a_prompt_sample_independently(
        self, subject: ConformanceSubject, data: st.DataObject
    ):
        """Eight copies of one prompt, sampled, do not all give the same continuation."""
        prompt = data.draw(prompts(subject.vocab_size, min_rows=1, max_rows=1), label="prompt")[0]
        batch = pad_prompts(
            [prompt] * 8, "right", pad_token_id=subject.backend.config["pad_token_id"]
        )
        output = subject.backend.generate(batch, greedy=False)
        rows = {tuple(row.tolist()) for row in output["output_ids"]}
        assert len(rows) > 1, f"8 sampled rows of prompt {prompt} are all identical: {rows}"

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_row_independent_of_batch_mates(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Row i's output does not change when the other rows of its batch change."""
        drawn = self._draw(data, subject, min_rows=2)
        i = data.draw(st.integers(0, len(drawn.prompts) - 1), label="row")
        others = data.draw(
            prompts(subject.vocab_size, min_rows=len(drawn.prompts), max_rows=len(drawn.prompts)),
            label="other rows",
        )
        mates = [drawn.prompts[i] if j == i else others[j] for j in range(len(others))]
        pad = subject.backend.config["pad_token_id"]
        first = subject.backend.generate(drawn.data, greedy=greedy).select_indices([i])
        second = subject.backend.generate(
            pad_prompts(mates, "left", pad_token_id=pad), greedy=greedy
        )
        self._assert_same(subject, first, second.select_indices([i]), f"row {i} with new mates")
        if greedy:
            alone = subject.backend.generate(
                pad_prompts([drawn.prompts[i]], "right", pad_token_id=pad), greedy=True
            )
            self._assert_same(subject, first, alone, f"row {i} alone")

    @_property
    @given(data=st.data(), greedy=st.booleans())
    def test_padding_layout_does_not_matter(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Left, right, mixed padding and input_lengths give the same output."""
        rows = data.draw(
            prompts(subject.vocab_size, max_rows=self.max_rows, max_length=self.max_prompt_length),
            label="prompts",
        )
        pad = subject.backend.config["pad_token_id"]
        offsets = data.draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)))
        outputs = {
            padding: subject.backend.generate(
                pad_prompts(rows, padding, pad_token_id=pad, offsets=offsets), greedy=greedy
            )
            for padding in PADDINGS
        }
        for padding in PADDINGS[1:]:
            self._assert_same(subject, outputs["left"], outputs[padding], f"{padding} vs left")

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

    @_property
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

    # ---- score --------------------------------------------------------------------------------

    @_property
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

    @_property
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
        with share_weights(_perturbed(original)) as shared:
            backend.update_weights_from_ipc_handles(shared.handles)
            leftover = [
                b["location"] for b in shared.handles["buckets"] if os.path.exists(b["location"])
            ]
        assert not leftover, f"shared-memory segments left after the update: {leftover}"
        changed = backend.generate(batch, greedy=True)
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

    @pytest.mark.parametrize("fault", ["wrong shape", "unknown name", "wrong dtype"])
    def test_mismatched_weight_update_refused(self, subject: ConformanceSubject, fault: str):
        """An update that does not fit the model raises WeightUpdateError and changes nothing."""
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
        else:
            bad[name] = bad[name].to(torch.float64)
        with pytest.raises(WeightUpdateError):
            backend.prepare_refit_info({k: (v.shape, v.dtype) for k, v in bad.items()})
        with share_weights(bad) as shared, pytest.raises(WeightUpdateError):
            backend.update_weights_from_ipc_handles(shared.handles)
        after = backend.generate(batch, greedy=True)
        assert torch.equal(after["output_ids"], before["output_ids"])
        assert torch.equal(after["logprobs"], before["logprobs"]), (
            "a refused update changed outputs"
        )


def _state_dict_of(subject: ConformanceSubject) -> dict[str, torch.Tensor]:
    if subject.state_dict is None:
        raise AssertionError("claims_weight_updates needs ConformanceSubject.state_dict")
    return {k: v.detach().clone() for k, v in subject.state_dict.items()}


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
