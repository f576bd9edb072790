"""Per-row ``vllm.SamplingParams`` arguments, as plain dicts that cross the Ray boundary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gen_interface import sampling_settings_of

__all__ = ["row_sampling_params"]


def row_sampling_params(
    config: Mapping[str, Any],
    *,
    greedy: bool,
    seeds: Sequence[int],
    prompt_lengths: Sequence[int],
    stop_strings: Sequence[Sequence[str]],
    context_limit: int,
) -> list[dict[str, Any]]:
    """``SamplingParams`` keyword arguments for each row of one call.

    Rows stop only on the config's stop tokens (``ignore_eos``: the model's own eos counts only
    when it is listed), keep stop strings in their output, and may not run past the context
    limit. ``logprobs=0`` returns the emitted token's log-probability in the engine's
    ``logprobs_mode``; greedy rows use temperature 0, for which vLLM reports raw values.
    """
    temperature, top_k, top_p = sampling_settings_of(config)  # type: ignore[arg-type]
    stop_token_ids = list(config.get("stop_token_ids") or [])
    rows = []
    for seed, length, strings in zip(seeds, prompt_lengths, stop_strings):
        params: dict[str, Any] = {
            "max_tokens": min(int(config["max_new_tokens"]), context_limit - length),
            "stop_token_ids": stop_token_ids,
            "ignore_eos": True,
            "logprobs": 0,
            "detokenize": bool(strings),
        }
        if strings:
            params["stop"] = list(strings)
            params["include_stop_str_in_output"] = True
        if greedy:
            params["temperature"] = 0.0
        else:
            params.update(temperature=temperature, top_p=top_p, top_k=top_k or 0, seed=seed)
        rows.append(params)
    return rows
