"""The logit processor that samples every sampled row on an SGLang server, as every backend of
this project samples.

It runs inside the server (``support_dir`` puts it on the path), before SGLang's sampler, and
makes the choice itself with ``gen_backend_kit.sampling.select_next_tokens``, the reference
decoding step gen-hf runs: the row's temperature, min-p, top-k and top-p in this project's order
and tie rules, and a draw from a torch generator seeded with the row's seed that lives on the
request for its whole life. So a row's tokens depend on its seed and its logits alone, as on
gen-hf, which SGLang's own sampler cannot give on the CPU (it honours seeds only in its
deterministic-inference mode, a GPU mode).

The processor hands the choice to SGLang by returning logits that allow only the chosen token,
and hands back what SGLang would no longer report right, the token's logprob and the row's top
logprobs (raw or processed, as the row asks), through the request's ``customized_info`` under
``CHOICE_KEY``: one ``[token, logprob, top_ids, top_logprobs]`` entry per generated token, which
SGLang streams in each chunk's ``meta_info`` beside the tokens it committed.

SGLang runs a forward before it has taken the previous one's tokens, and drops a request's
token when the request is retracted meanwhile (memory pressure, or a ``retract`` pause); it then
computes that position again. So the choices are kept per position: after a retraction, the
choices past the tokens SGLang committed are dropped and the generator goes back to its state
before the first of them, so the row draws as if the dropped forward had never run.

A processor that raises stops SGLang's scheduler, so a failure here is reported in the row
instead (an ``["error", message]`` entry) and the row goes on unchanged; the client ends the
call with the message. A row whose settings cannot be read fails alone: rows of other calls
batched with it (a failed call's rows may run on until the server notices) are sampled as
always.

A row's ``custom_params``: ``{"seed": int, "temperature": float, "top_k": int | None,
"top_p": float, "min_p": float, "top_logprobs": int, "processed": bool}``; SGLang adds
``"__req__"``, the request.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from gen_backend_kit.row_sampling import RowSampling
from gen_backend_kit.sampling import row_generators, select_next_tokens
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

#: The ``customized_info`` (and so ``meta_info``) key of each token's choice.
CHOICE_KEY = "gen_sglang_choice"


class RowSampler(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        params = custom_param_list or []
        try:
            live: list[int] = []
            rows: list[RowSampling] = []
            for i, p in enumerate(params):
                # A request whose prompt is still being prefilled in chunks gets no token from
                # this forward: its generator must not move.
                if not _takes_a_token(p["__req__"]):
                    continue
                try:
                    rows.append(_row(p))
                except Exception:  # settings it cannot read fail this row, not its batch
                    _report(p, traceback.format_exc(limit=4))
                    continue
                live.append(i)
            return _choose(logits, [params[i] for i in live], rows, live) if live else logits
        except Exception:  # a raise here would stop SGLang's scheduler (see the docstring)
            message = traceback.format_exc(limit=4)
            for p in params:
                _report(p, message)
            return logits


def _report(p: dict[str, Any], message: str) -> None:
    """Fail the row in its stream (``["error", message]``); it goes on unchanged meanwhile."""
    with contextlib.suppress(Exception):
        _draws(p["__req__"]).choices.append(["error", message])


@dataclass
class _Draws:
    """What a request keeps between forwards: its generator, its choices (the list SGLang
    streams), the generator's state before each choice not yet committed, and the retraction
    count the choices were made under."""

    generator: torch.Generator
    choices: list[Any]
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    retractions: int = 0


def _choose(
    logits: torch.Tensor, params: list[dict[str, Any]], rows: list[RowSampling], live: list[int]
) -> torch.Tensor:
    """Choose the ``live`` rows' tokens; returns ``logits`` ``[N, V]`` with each live row
    allowing only its token (every other entry ``-inf``), the other rows as they came.

    ``logits`` is overwritten in place: SGLang hands a processor a copy of its rows
    (``index_select``) and copies the result back, so nothing else reads it. The work per step
    is a few whole-batch tensor operations and one list per row; only the draws are per row,
    each from its own generator.
    """
    reqs = [p["__req__"] for p in params]
    draws = [_draws(req, row.seed) for req, row in zip(reqs, rows, strict=True)]
    for req, kept in zip(reqs, draws, strict=True):
        _forget_dropped(req, kept)
        kept.states[len(kept.choices)] = kept.generator.get_state()
    every = len(live) == logits.shape[0]
    index = None if every else torch.tensor(live, dtype=torch.int64, device=logits.device)
    choice = select_next_tokens(
        logits if index is None else logits.index_select(0, index),
        rows,
        processed=bool(params[0]["processed"]),
        generators=[kept.generator for kept in draws],
    )
    tokens, logprobs = choice.tokens.tolist(), choice.logprobs.tolist()
    most = choice.topk_ids.shape[1]
    top_ids = choice.topk_ids.tolist() if most else None
    top_logprobs = choice.topk_logprobs.tolist() if most else None
    for j, (row, kept) in enumerate(zip(rows, draws, strict=True)):
        k = row.top_logprobs
        kept.choices.append(
            [
                tokens[j],
                logprobs[j],
                top_ids[j][:k] if top_ids is not None else [],
                top_logprobs[j][:k] if top_logprobs is not None else [],
            ]
        )
    chosen = choice.tokens.to(logits.device)
    if index is None:
        logits.fill_(float("-inf")).scatter_(1, chosen.reshape(-1, 1), 0.0)
    else:
        logits.index_fill_(0, index, float("-inf"))
        logits.index_put_((index, chosen), torch.zeros((), dtype=logits.dtype))
    return logits


def _takes_a_token(req: Any) -> bool:
    """Whether this forward gives the request a token (not a middle chunk of its prompt)."""
    return not req.finished() and req.inflight_middle_chunks <= 0


def _forget_dropped(req: Any, kept: _Draws) -> None:
    """Drop the choices SGLang dropped with a retraction, and rewind the generator to before
    the first of them; forget the saved states of committed choices."""
    committed = len(req.output_ids)
    if req.retraction_count != kept.retractions:
        kept.retractions = req.retraction_count
        if len(kept.choices) > committed:
            kept.generator.set_state(kept.states[committed])
            del kept.choices[committed:]
    for position in [p for p in kept.states if p < committed]:
        del kept.states[position]


def _row(p: dict[str, Any]) -> RowSampling:
    return RowSampling(
        max_new_tokens=1,
        temperature=float(p["temperature"]),
        top_k=p["top_k"],
        top_p=float(p["top_p"]),
        stop_token_ids=(),
        stop_strings=(),
        seed=int(p["seed"]),
        min_p=float(p["min_p"]),
        top_logprobs=int(p["top_logprobs"]),
    )


def _draws(req: Any, seed: int = 0) -> _Draws:
    """The request's ``_Draws``, made at its first token; its choices are the list SGLang
    streams (``req.customized_info[CHOICE_KEY]``)."""
    kept = getattr(req, "_gen_sglang_draws", None)
    if kept is None:
        if req.customized_info is None:
            req.customized_info = {}
        choices = req.customized_info.setdefault(CHOICE_KEY, [])
        (generator,) = row_generators([seed])
        kept = _Draws(generator, choices, retractions=req.retraction_count)
        req._gen_sglang_draws = kept
    return kept
