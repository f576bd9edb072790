"""The benchmarks' requests: random token-id prompts, each with its own token budget and seed,
the left-padded batch that carries them to a backend's ``generate``, and the config every
benchmark's backend samples with."""

from __future__ import annotations

import random
from typing import Any

import torch
from gen_interface import BatchedDataDict

#: Per request: its prompt's token ids, its ``max_tokens`` and its sampling seed.
Work = list[tuple[list[int], int, int]]


def random_requests(count: int, vocab: int, new: str, prompt: str, seed: int = 0) -> Work:
    """``count`` requests drawn with ``seed``: prompts of ids in ``[3, vocab)`` whose lengths
    lie in ``prompt`` (``"shortest,longest"``), budgets in ``new`` (``"smallest,largest"``),
    seeds 1000, 1001, ... The first ``k`` of them are the same whatever ``count``."""
    rng = random.Random(seed)
    low, high = (int(x) for x in new.split(","))
    shortest, longest = (int(x) for x in prompt.split(","))
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randint(shortest, longest))],
            rng.randint(low, high),
            1000 + i,
        )
        for i in range(count)
    ]


def left_padded(prompts: list[list[int]]) -> BatchedDataDict[Any]:
    """``input_ids`` and ``attention_mask`` of the prompts, padded on the left with id 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return BatchedDataDict(input_ids=ids, attention_mask=mask)


def sampled_config(backend: str, model: str, max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    """The config the benchmarks run a backend with: plain sampling at temperature 1 (no top-k
    or top-p), raw logprobs, float32, no stop tokens, seed 0; ``extra`` adds backend sections
    (``vllm_cfg`` ...)."""
    return {
        "backend": backend,
        "model_name": model,
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": [],
        "pad_token_id": 0,
        "seed": 0,
        "dtype": "float32",
        "logprobs_mode": "raw",
        **extra,
    }
