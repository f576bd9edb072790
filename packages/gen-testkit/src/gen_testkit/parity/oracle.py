"""Exact next-token logits of a model, independent of any backend under test.

The sampling-distribution check compares what a backend samples with the distribution it should
sample from; that distribution is computed here, from a plain forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from gen_backend_kit.sampling import processed_log_probs

from gen_testkit.strategies import pad_prompts

__all__ = ["HfLogitsOracle", "LogitsOracle", "NgramLogitsOracle", "processed_distribution"]


class LogitsOracle(Protocol):
    """Anything that gives a model's exact logits."""

    def next_token_logits(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits ``[N, V]`` of the token after each of N prefixes."""
        ...

    def sequence_logits(self, sequence: Sequence[int]) -> torch.Tensor:
        """Logits ``[T, V]``: row t predicts token t + 1 of ``sequence``."""
        ...


class HfLogitsOracle:
    """A transformers forward pass over each prefix (float32 unless told otherwise)."""

    def __init__(self, model_dir: str, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.eval()

    @torch.inference_mode()
    def next_token_logits(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([self.sequence_logits(p)[-1] for p in prefixes])

    @torch.inference_mode()
    def sequence_logits(self, sequence: Sequence[int]) -> torch.Tensor:
        return self.model(torch.tensor([list(sequence)])).logits[0].float()

    @torch.inference_mode()
    def exact_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The trainer-side exact logprobs ``[T_i]`` of each sequence (``sequence_logprobs``,
        batch-invariant kernels), in one right-padded batch."""
        from gen_hf.exact import sequence_logprobs

        batch = pad_prompts(sequences, "right")
        logprobs = sequence_logprobs(self.model, batch["input_ids"], batch["attention_mask"])
        return [logprobs[i, : len(s)] for i, s in enumerate(sequences)]


class NgramLogitsOracle:
    """The n-gram backend's model, read directly."""

    def __init__(self, model: object):
        self.model = model

    def next_token_logits(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.model.next_logits([list(p) for p in prefixes])  # type: ignore[attr-defined]

    def sequence_logits(self, sequence: Sequence[int]) -> torch.Tensor:
        return self.model.sequence_logits(list(sequence))  # type: ignore[attr-defined]


def processed_distribution(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """Probabilities ``[N, V]`` of the distribution a backend must sample from."""
    return processed_log_probs(logits, temperature, top_k, top_p).exp()
