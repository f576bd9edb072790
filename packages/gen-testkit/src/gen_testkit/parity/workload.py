"""The fixed, seeded inputs and settings of a parity run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from gen_interface import BatchedDataDict, GenerationDatumSpec

from gen_testkit.strategies import PADDINGS, pad_prompts

__all__ = ["PARITY_SETTINGS", "ParityBatch", "SamplingPlan", "parity_batches", "sampling_plan"]

#: Sampling settings of every parity run: all three filters active, processed logprobs, so one
#: engine per backend shows greedy (raw), teacher-forced (raw) and processed values.
PARITY_SETTINGS: dict[str, Any] = {
    "max_new_tokens": 16,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "logprobs_mode": "processed",
    "seed": 1234,
}


@dataclass(frozen=True)
class ParityBatch:
    """One input batch and its unpadded prompts."""

    data: BatchedDataDict[GenerationDatumSpec]
    prompts: list[list[int]]

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]


@dataclass(frozen=True)
class SamplingPlan:
    """Prefixes to sample many first tokens after, each row with its own seed and one new token
    (only the first is tested)."""

    prefixes: list[list[int]]
    samples_per_prefix: int

    def batch(self, prefix: list[int]) -> BatchedDataDict[GenerationDatumSpec]:
        data = pad_prompts([prefix] * self.samples_per_prefix, "right")
        data["sample_seeds"] = torch.arange(self.samples_per_prefix, dtype=torch.int64) * 7919 + 1
        data["max_new_tokens"] = torch.ones(self.samples_per_prefix, dtype=torch.int64)
        return data


def parity_batches(vocab_size: int, seed: int = 0) -> list[ParityBatch]:
    """Three batches (8, 5 and 3 rows, prompts of 1 to 24 tokens), one per padding layout and
    one with ``input_lengths``, drawn from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for rows, padding in zip((8, 5, 3, 4), PADDINGS):
        lengths = torch.randint(1, 25, (rows,), generator=generator).tolist()
        prompts = [
            torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths
        ]
        out.append(ParityBatch(pad_prompts(prompts, padding), prompts))
    return out


def sampling_plan(vocab_size: int, samples_per_prefix: int, seed: int = 1) -> SamplingPlan:
    generator = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (3, 9)]
    return SamplingPlan(prefixes, samples_per_prefix)
