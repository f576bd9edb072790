"""Per-row ``vllm.SamplingParams`` arguments, as plain dicts that cross the Ray boundary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gen_backend_kit import BatchSampling

__all__ = ["row_sampling_params"]


def row_sampling_params(
    sampling: BatchSampling, *, prompt_lengths: Sequence[int], context_limit: int
) -> list[dict[str, Any]]:
    """``SamplingParams`` keyword arguments for each row of one call, from its resolved sampling.

    Rows stop only on their own stop tokens (``ignore_eos``: the model's own eos counts only
    when it is listed), keep stop strings in their output, and may not run past the context
    limit. ``logprobs=k`` returns the emitted token's log-probability and the k likeliest, in the
    engine's ``logprobs_mode``; greedy rows use temperature 0, for which vLLM reports raw values.
    """
    params = []
    for row, length in zip(sampling.rows, prompt_lengths):
        row_params: dict[str, Any] = {
            "max_tokens": min(row.max_new_tokens, context_limit - length),
            "stop_token_ids": list(row.stop_token_ids),
            "ignore_eos": True,
            "logprobs": row.top_logprobs,
            "detokenize": bool(row.stop_strings),
        }
        if row.stop_strings:
            row_params["stop"] = list(row.stop_strings)
            row_params["include_stop_str_in_output"] = True
        if row.greedy:
            row_params["temperature"] = 0.0
        else:
            row_params.update(
                temperature=row.temperature,
                top_p=row.top_p,
                top_k=row.top_k or 0,
                min_p=row.min_p,
                seed=row.seed,
            )
        params.append(row_params)
    return params
