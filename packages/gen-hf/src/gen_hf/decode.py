"""The decoding loop: prefill once, then one token per step on the model's KV cache.

Prompts are left-padded so every row's next token sits in the last column; ``position_ids``
count each row's real tokens, so padding never shifts a row's positions and the padding layout
of the input cannot change its result. Each step picks tokens with the reference decoding step
(``gen_backend_kit.sampling.select_next_tokens``, each row with its own ``RowSampling``) and stops
rows with the call's ``StopRules``. Every forward pass is one step of the call's ``StepGate``.
Rows that finish are dropped from the batch and the cache, and so are the leading cache columns
that only finished rows needed, so they stop costing compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from gen_backend_kit import BatchSampling, RowResult
from gen_backend_kit.decoding import StopRules
from gen_backend_kit.sampling import select_next_tokens
from gen_backend_kit.stepping import GeneratedRows, RowControl, StepGate
from gen_interface import GenerationError
from transformers import DynamicCache

from gen_hf.cache import drop_leading_columns, new_group_cache
from gen_hf.loading import LoadedModel
from gen_hf.routing import RouterCapture

__all__ = ["DecodeCall", "decode_batch", "decode_rows", "forward_errors"]

# Id placed in padded prompt positions: masked out, it only has to be a valid embedding row.
_FILL_ID = 0


@dataclass(frozen=True)
class DecodeCall:
    """One call's decoding, as ``decode_batch`` runs it.

    Attributes:
        sampling: every row's sampling (call row order).
        rules: the call's stop rules.
        generators: one per call row; sampling draws from them on the CPU, so a row's sample
            depends only on its own seed.
        gate: steps take turns with weight updates through it.
        mark: ``gate.enter()`` when the call began (an ``"abort"`` update after it cuts it).
        control: who hears of finished rows, and the flag that ends the call early.
        routing: reads each pass's MoE routing, for rows' ``routed_experts``; None: not asked.
    """

    sampling: BatchSampling
    rules: StopRules
    generators: Sequence[torch.Generator]
    gate: StepGate
    mark: int
    control: RowControl
    routing: RouterCapture | None = None

    def finished(self, row: int, result: RowResult) -> RowResult:
        return self.control.finished(row, result)


def decode_batch(
    loaded: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    device: torch.device,
    max_batch_size: int,
    call: DecodeCall,
) -> list[RowResult | None]:
    """Generate for every prompt of a call, ``max_batch_size`` rows per group.

    Rows of similar prompt length share a group, so groups carry little padding; a row's
    result does not depend on its group (see ``decode_rows``).

    Args:
        loaded: the model.
        prompts: the call's unpadded prompts, in input order.
        device, call: as for ``decode_rows``.
        max_batch_size: most rows per forward pass.

    Returns:
        One ``RowResult`` per prompt, in input order (None for rows not run because
        ``call.control.cancelled`` was set).

    Raises:
        GenerationError: a forward pass failed (out of memory, a kernel error).
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, RowResult] = {}
    with torch.inference_mode(), forward_errors():
        for start in range(0, len(order), max_batch_size):
            if call.control.cancelled.is_set():
                break
            rows = order[start : start + max_batch_size]
            group = decode_rows(loaded, [prompts[i] for i in rows], rows, device=device, call=call)
            results.update(zip(rows, group))
    return [results.get(i) for i in range(len(prompts))]


@contextmanager
def forward_errors() -> Iterator[None]:
    """Turn a failing forward pass (out of memory, a kernel error) into ``GenerationError``."""
    try:
        yield
    except RuntimeError as exc:
        raise GenerationError(
            f"the model's forward pass failed: {exc}. If memory ran out, lower "
            "hf_cfg.max_batch_size or max_new_tokens."
        ) from exc


def decode_rows(
    loaded: LoadedModel,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[int],
    *,
    device: torch.device,
    call: DecodeCall,
) -> list[RowResult]:
    """Generate for a group of rows that fits one forward pass.

    Each forward pass is one step through ``call.gate``: a weight update runs between steps,
    never during one. Each token records the version of the weights whose logits chose it; a
    row's ``weight_version`` is the version its prompt was read with. A call cut short by an
    ``"abort"`` update ends its rows at the next step with their tokens so far.

    Args:
        loaded: the model.
        prompts: the group's unpadded prompts (each at least one token, shorter than the
            context limit).
        rows: each prompt's row index in the call (its sampling, rules and generator).
        device: the model's device.
        call: the call's sampling, rules and generators, its gate and mark, and its control.

    Returns:
        One ``RowResult`` per prompt, in the order given (none when the call is cancelled).
    """
    count = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    rules = call.rules
    most_new = max(rules.max_new_tokens[r] for r in rows)
    # [A, width + most_new]: ones past the prompts, so each step's mask is a view.
    mask = torch.ones((count, width + most_new), dtype=torch.int64)
    input_ids = torch.full((count, width), _FILL_ID, dtype=torch.int64)
    for i, prompt in enumerate(prompts):
        pad = width - lengths[i]
        mask[i, :pad] = 0
        input_ids[i, pad:] = torch.as_tensor(prompt, dtype=torch.int64)
    mask = mask.to(device)
    input_ids = input_ids.to(device)
    positions = (mask[:, :width].cumsum(dim=1) - 1).clamp(min=0)  # [A, width]

    cache = new_group_cache(loaded.model.config, width + most_new)
    with call.gate.step(call.mark) as ticket:
        if ticket.cut:
            cut = RowResult.ended("abort", [], [], weight_version=ticket.version)
            return [call.finished(r, cut) for r in rows]
        if call.routing is not None:
            call.routing.clear()  # what a failed pass of another group may have left
        logits = _forward(loaded, input_ids, mask[:, :width], positions, cache)
        start_version = version = ticket.version  # of the weights behind ``logits``
        routed = _RoutedRows.after_prefill(call.routing, lengths, width)
    next_position = positions[:, -1] + 1  # [A]
    leading_pads = [width - n for n in lengths]
    generator_of = [call.generators[r] for r in rows]
    sampling_of = [call.sampling.rows[r] for r in rows]

    generated = GeneratedRows(
        [row.top_logprobs for row in sampling_of], call_rows=rows, control=call.control
    )
    results: list[RowResult | None] = [None] * count

    def finish(a: int, reason: str) -> None:
        result = generated.ended(a, reason, start_version)
        results[a] = call.finished(rows[a], routed.attach(a, result))

    active = list(range(count))  # group-local index of each row still running, batch order
    while True:
        choice = select_next_tokens(
            logits,
            [sampling_of[a] for a in active],
            processed=call.sampling.processed,
            generators=[generator_of[a] for a in active],
        )
        generated.record(active, choice, version)
        keep: list[int] = []
        for slot, a in enumerate(active):
            reason = rules.reason(rows[a], lengths[a], generated.tokens[a])
            if reason is None:
                keep.append(slot)
            else:
                finish(a, reason)
        generated.publish()
        if not keep:
            break
        tokens = choice.tokens.to(device)
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.int64, device=device)
            cache.batch_select_indices(index)
            mask, tokens, next_position = mask[index], tokens[index], next_position[index]
            active = [active[s] for s in keep]
            trim = min(leading_pads[a] for a in active)
            if trim and drop_leading_columns(cache, trim):
                mask = mask[:, trim:]
                width -= trim
                leading_pads = [n - trim for n in leading_pads]
        width += 1
        if call.control.cancelled.is_set():
            return []
        with call.gate.step(call.mark) as ticket:
            if ticket.cut:
                for a in active:
                    finish(a, "abort")
                break
            logits = _forward(
                loaded, tokens[:, None], mask[:, :width], next_position[:, None], cache
            )
            version = ticket.version
            routed.after_step(active)
        next_position = next_position + 1
    return [r for r in results if r is not None]


class _RoutedRows:
    """Each row's routing so far, from the passes of one group (nothing without a capture)."""

    def __init__(self, capture: RouterCapture | None, per_row: list[list[torch.Tensor]]):
        self._capture = capture
        self._per_row = per_row  # row a: pieces of [positions, layers, k], in position order

    @classmethod
    def after_prefill(
        cls, capture: RouterCapture | None, lengths: Sequence[int], width: int
    ) -> _RoutedRows:
        """The prompts' routing, read from the left-padded prefill (padding dropped)."""
        if capture is None:
            return cls(None, [])
        prefill = capture.take(len(lengths))  # [A, width, layers, k]
        return cls(capture, [[prefill[a, width - n :]] for a, n in enumerate(lengths)])

    def after_step(self, active: Sequence[int]) -> None:
        """The routing of one decode step, which read one token of each ``active`` row."""
        if self._capture is not None:
            step = self._capture.take(len(active))  # [A_active, 1, layers, k]
            for slot, a in enumerate(active):
                self._per_row[a].append(step[slot])

    def attach(self, a: int, result: RowResult) -> RowResult:
        if self._capture is None:
            return result
        return dataclasses.replace(result, routed_experts=torch.cat(self._per_row[a]))


def _forward(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
) -> torch.Tensor:
    """Run ``input_ids`` ``[A, Q]`` through the model, extending ``cache``.

    Returns:
        The last position's logits ``[A, V]``.
    """
    extra = {"logits_to_keep": 1} if loaded.keeps_last_logits else {}
    out = loaded.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        **extra,
    )
    return out.logits[:, -1, :]
