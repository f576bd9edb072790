"""The suite's shared pieces: the subject, its config, the property settings, helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch
from gen_interface import BatchedDataDict, GenerationInterface
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gen_testkit.compare import compare_generations
from gen_testkit.strategies import DrawnBatch, generation_batches, pad_prompts
from gen_testkit.tolerances import tolerance_for

if TYPE_CHECKING:
    from gen_testkit.models import TinyModel

__all__ = [
    "FIXED_PROMPTS",
    "ConformanceSubject",
    "SuiteBase",
    "conformance_config",
    "property_settings",
]

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
        fail_rows: ``fail_rows(True)`` makes the backend's engine fail every row it runs from
            then on, as a failing kernel or an engine error would; ``fail_rows(False)`` ends
            that. None when the backend offers no way to (the check is then skipped).
    """

    backend: GenerationInterface
    vocab_size: int
    state_dict: Mapping[str, torch.Tensor] | None = None
    fail_rows: Callable[[bool], None] | None = None

    @classmethod
    def for_model(
        cls,
        backend: GenerationInterface,
        model: TinyModel,
        fail_rows: Callable[[bool], None] | None = None,
    ) -> ConformanceSubject:
        """The subject of a backend serving one of the testkit's built models."""
        return cls(backend, model.vocab_size, model.state_dict(), fail_rows)

    def __repr__(self) -> str:
        return f"ConformanceSubject({type(self.backend).__name__}, vocab_size={self.vocab_size})"


def _examples() -> int:
    """Examples per property: half the active hypothesis profile's, at least 3."""
    return max(3, settings().max_examples // 2)


property_settings = settings(
    max_examples=_examples(),
    deadline=None,
    # the same property runs for every backend class that inherits it
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.differing_executors,
    ],
)


class SuiteBase:
    """Flags, the ``subject`` fixture a backend's test class overrides, and shared helpers."""

    #: ``update_weights_from_ipc_handles`` and ``prepare_refit_info`` work (needs a state dict).
    claims_weight_updates: ClassVar[bool] = False
    #: ``weight_base()`` answers: weight updates may carry deltas against the committed
    #: weights (``gen_testkit.suite.deltas``).
    claims_weight_deltas: ClassVar[bool] = False
    #: ``score`` works.
    claims_score: ClassVar[bool] = False
    #: Largest batch and prompt the properties draw.
    max_rows: ClassVar[int] = 6
    max_prompt_length: ClassVar[int] = 12
    #: Prompt tokens and rows of the large-batch check: more prompt tokens than an engine
    #: schedules in one step (vLLM on CPU: 4,096 by default, where a larger call once killed
    #: the engine). Needs a context limit above ``large_batch_tokens / large_batch_rows``.
    large_batch_tokens: ClassVar[int] = 6144
    large_batch_rows: ClassVar[int] = 48
    #: Loads are staged and reach the served weights only at the commit (gen-sglang): an update
    #: dropped midway leaves them whole, so the rows it paused go on.
    stages_whole_updates: ClassVar[bool] = False

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[ConformanceSubject]:
        """Override in the subclass: build the backend from ``conformance_config``."""
        raise NotImplementedError(f"{cls.__name__} must override the subject fixture")
        yield  # pragma: no cover

    def test_subject_is_built_from_the_conformance_config(self, subject: ConformanceSubject):
        """The properties rely on the conformance config's short rows and many stop tokens."""
        config = subject.backend.config
        expected = conformance_config(
            backend=config["backend"],
            model_name=config["model_name"],
            vocab_size=subject.vocab_size,
            pad_token_id=config["pad_token_id"],
        )
        for key in ("max_new_tokens", "temperature", "top_k", "top_p", "stop_token_ids", "seed"):
            assert config[key] == expected[key], f"subject's {key} is {config[key]!r}"

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
