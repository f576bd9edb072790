"""The CONTRACT's per-output rules as plain check functions.

Each check takes the prompts that went in and the output that came out and raises
``AssertionError`` with the row and the rule when the output breaks a rule. The conformance suite
runs them on every drawn batch; anyone can run them on any output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "OUTPUT_DTYPES",
    "check_layout",
    "check_lengths",
    "check_logprob_range",
    "check_padding",
    "check_prompt_kept",
    "check_stop_rules",
]

#: The dtype of every field of ``GenerationOutputSpec``.
OUTPUT_DTYPES: dict[str, torch.dtype] = {
    "output_ids": torch.int64,
    "logprobs": torch.float32,
    "generation_lengths": torch.int64,
    "unpadded_sequence_lengths": torch.int64,
    "truncated": torch.bool,
    "cut_short": torch.bool,
    "weight_version": torch.int64,
    "weight_versions": torch.int64,
    "topk_ids": torch.int64,
    "topk_logprobs": torch.float32,
}

# log_softmax may round the top log-probability a hair above zero.
_LOGPROB_CEILING = 1e-6


def check_layout(prompts: Sequence[Sequence[int]], output: Mapping[str, Any]) -> None:
    """Every field present with its dtype and shape; ``L = max(p + g)``; ``unpadded = p + g``."""
    for key, dtype in OUTPUT_DTYPES.items():
        assert key in output, f"output lacks {key!r}"
        value = output[key]
        assert isinstance(value, torch.Tensor), f"{key} is a {type(value).__name__}, not a tensor"
        assert value.dtype == dtype, f"{key} is {value.dtype}, the CONTRACT says {dtype}"
    batch = len(prompts)
    ids, logprobs = output["output_ids"], output["logprobs"]
    assert ids.dim() == 2 and ids.shape[0] == batch, f"output_ids is {tuple(ids.shape)}, B={batch}"
    assert logprobs.shape == ids.shape, f"logprobs {tuple(logprobs.shape)} != {tuple(ids.shape)}"
    versions = output["weight_versions"]
    assert versions.shape == ids.shape, f"weight_versions {tuple(versions.shape)} != {ids.shape}"
    top_ids, top_values = output["topk_ids"], output["topk_logprobs"]
    assert top_ids.dim() == 3 and top_ids.shape[:2] == ids.shape, (
        f"topk_ids is {tuple(top_ids.shape)}, output_ids {tuple(ids.shape)}"
    )
    assert top_values.shape == top_ids.shape, f"topk_logprobs {tuple(top_values.shape)}"
    for key in (
        "generation_lengths",
        "unpadded_sequence_lengths",
        "truncated",
        "cut_short",
        "weight_version",
    ):
        assert tuple(output[key].shape) == (batch,), f"{key} is {tuple(output[key].shape)}"
    p = torch.tensor([len(r) for r in prompts], dtype=torch.int64)
    expected_total = p + output["generation_lengths"]
    assert torch.equal(output["unpadded_sequence_lengths"], expected_total), (
        f"unpadded_sequence_lengths {output['unpadded_sequence_lengths'].tolist()} != "
        f"prompt + generated {expected_total.tolist()}"
    )
    width = int(expected_total.max()) if batch else 0
    assert ids.shape[1] == width, f"output width is {ids.shape[1]}, max(p + g) is {width}"


def check_prompt_kept(prompts: Sequence[Sequence[int]], output: Mapping[str, Any]) -> None:
    """Row i starts with its unpadded prompt."""
    for i, prompt in enumerate(prompts):
        head = output["output_ids"][i, : len(prompt)].tolist()
        assert head == list(prompt), f"row {i} starts with {head}, its prompt is {list(prompt)}"


def check_padding(
    prompts: Sequence[Sequence[int]], output: Mapping[str, Any], pad_token_id: int
) -> None:
    """``pad_token_id`` after each row's end; logprobs and weight versions 0 everywhere but
    generated positions, where versions start at the row's ``weight_version`` and never fall."""
    ids, logprobs, versions = output["output_ids"], output["logprobs"], output["weight_versions"]
    for i, prompt in enumerate(prompts):
        end = int(output["unpadded_sequence_lengths"][i])
        tail = ids[i, end:]
        assert bool((tail == pad_token_id).all()), (
            f"row {i} holds {tail.tolist()} after its end, not pad_token_id {pad_token_id}"
        )
        for name, values in (("logprobs", logprobs), ("weight_versions", versions)):
            outside = torch.cat([values[i, : len(prompt)], values[i, end:]])
            assert bool((outside == 0).all()), (
                f"row {i} has non-zero {name} outside its generated positions: {outside.tolist()}"
            )
        produced = versions[i, len(prompt) : end].tolist()
        started = int(output["weight_version"][i])
        assert not produced or (produced[0] == started and produced == sorted(produced)), (
            f"row {i} started on weight version {started} but its tokens carry {produced}"
        )


def check_lengths(output: Mapping[str, Any], max_new_tokens: int) -> None:
    """Every row generated between 1 and ``max_new_tokens`` tokens."""
    lengths = output["generation_lengths"]
    assert bool(((lengths >= 1) & (lengths <= max_new_tokens)).all()), (
        f"generation_lengths {lengths.tolist()} outside [1, max_new_tokens={max_new_tokens}]"
    )


def check_stop_rules(
    prompts: Sequence[Sequence[int]],
    output: Mapping[str, Any],
    stop_token_ids: Sequence[int],
    max_new_tokens: int,
) -> None:
    """A row ends at its first stop token (kept, not truncated), or runs to the limit (truncated,
    with no stop token); no row is cut short (no weight update ran in "abort" mode). Assumes
    prompts short enough that the context limit is not reached."""
    stops = set(stop_token_ids)
    assert not output["cut_short"].any(), f"rows cut short: {output['cut_short'].tolist()}"
    for i, prompt in enumerate(prompts):
        end = int(output["unpadded_sequence_lengths"][i])
        generated = output["output_ids"][i, len(prompt) : end].tolist()
        first_stop = next((j for j, t in enumerate(generated) if t in stops), None)
        truncated = bool(output["truncated"][i])
        if first_stop is not None:
            assert first_stop == len(generated) - 1, (
                f"row {i} emitted stop token {generated[first_stop]} at generated position "
                f"{first_stop} but went on to {len(generated)} tokens: {generated}"
            )
            assert not truncated, (
                f"row {i} ended with stop token {generated[-1]} but truncated=True"
            )
        else:
            assert truncated, f"row {i} ended without a stop token but truncated=False: {generated}"
            assert len(generated) == max_new_tokens, (
                f"row {i} stopped after {len(generated)} tokens with no stop token, before "
                f"max_new_tokens={max_new_tokens}"
            )


def check_logprob_range(prompts: Sequence[Sequence[int]], output: Mapping[str, Any]) -> None:
    """Generated positions hold finite log-probabilities <= 0."""
    for i, prompt in enumerate(prompts):
        end = int(output["unpadded_sequence_lengths"][i])
        values = output["logprobs"][i, len(prompt) : end]
        assert bool(torch.isfinite(values).all()), f"row {i} has non-finite logprobs {values}"
        assert bool((values <= _LOGPROB_CEILING).all()), f"row {i} has logprobs > 0: {values}"
