"""The reference speculative decoding step: a drafter proposes, the target verifies.

Standard speculative sampling (Leviathan et al., 2023; Chen et al., 2023), per row:

1. the drafter proposes ``k`` tokens one after another: greedy rows take its argmax, sampled
   rows draw ``d_j ~ q_j``, ``q_j`` being the drafter's distribution processed with the row's
   own temperature, top-k, top-p and min-p (``draft_sample_method`` "greedy": its argmax, with
   ``q_j`` one-hot on it, as vLLM's default does);
2. one target pass scores the ``k + 1`` positions: ``p_j`` (processed the same way);
3. draft ``j`` is accepted when the target agrees: greedy, ``d_j == argmax p_j``; sampled,
   ``u < p_j(d_j) / q_j(d_j)`` with ``u ~ U(0, 1)``. At the first rejection the row takes the
   target's argmax (greedy) or a draw from ``max(p_j - q_j, 0)`` renormalised (sampled), and
   the step ends; when all ``k`` are accepted it takes one more token from ``p_k``.

So a greedy row's tokens equal plain greedy decoding's, and a sampled row's tokens follow the
target's processed distribution at every position. Every emitted token is reported with the
target's logits (``report_tokens``): its logprob and top logprobs are the target's, raw or
processed as plain decoding reports them. Every draw comes from the row's own generator, so a
seed makes a row reproducible, but not equal to the same seed's row without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gen_backend_kit.row_sampling import RowSampling
from gen_backend_kit.sampling import TokenChoice, processed_log_probs, report_tokens

from gen_testkit.ngram.model import NgramModel

__all__ = ["SpeculativeDecoder", "SpeculativeStep"]


@dataclass(frozen=True)
class SpeculativeStep:
    """One verifying step of A rows.

    Attributes:
        emitted: position by position, the rows (indices into the step's A rows) that emit a
            token at that position and their ``TokenChoice``; row i emits ``accepted[i] + 1``
            tokens, so every row is in ``emitted[0]``.
        accepted: int ``[A]``: each row's draft tokens accepted.
        proposed: draft tokens proposed per row (``k``).
    """

    emitted: list[tuple[list[int], TokenChoice]]
    accepted: list[int]
    proposed: int


class SpeculativeDecoder:
    """Draft ``k`` tokens with ``drafter`` and verify them with ``target``; see the module."""

    def __init__(
        self, target: NgramModel, drafter: NgramModel, k: int, *, draw_drafts: bool = True
    ):
        if target.vocab_size != drafter.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({drafter.vocab_size}) must be the target's "
                f"({target.vocab_size})"
            )
        self.target, self.drafter, self.k = target, drafter, k
        #: Sampled rows draw drafts from the drafter (``draft_sample_method`` "probabilistic");
        #: False: they take its argmax, verified as certain (``q`` one-hot: "greedy").
        self.draw_drafts = draw_drafts

    def step(
        self,
        contexts: Sequence[Sequence[int]],
        rows: Sequence[RowSampling],
        *,
        processed: bool,
        generators: Sequence[torch.Generator],
        k: int | None = None,
    ) -> SpeculativeStep:
        """Propose ``k`` drafts (default: the decoder's; 0: a plain step, the target's draw) and
        verify and emit them for each of the A ``contexts`` (prompt and output so far).

        Raises:
            RuntimeError: a forward pass failed (the model's ``failing``).
        """
        count = len(contexts)
        k = self.k if k is None else k
        drafts: list[list[int]] = [[] for _ in range(count)]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in range(count)]
        for _ in range(k):
            logits = self.drafter.next_logits([[*c, *d] for c, d in zip(contexts, drafts)])
            for i, row in enumerate(rows):
                if row.greedy:
                    drafts[i].append(int(logits[i].argmax()))
                    continue
                q = self._probs(logits[i], row)
                if not self.draw_drafts:  # the argmax, as if the drafter were certain of it
                    q = torch.nn.functional.one_hot(q.argmax(), q.shape[0]).to(q.dtype)
                draft_probs[i].append(q)
                drafts[i].append(int(torch.multinomial(q, 1, generator=generators[i])))
        # one target pass over the k + 1 positions of every row: [A, k + 1, V]
        target = torch.stack(
            [
                self.target.next_logits([[*c, *d[:j]] for c, d in zip(contexts, drafts)])
                for j in range(k + 1)
            ],
            dim=1,
        )
        reported_logits = self._reported_logits(target, contexts, drafts)
        emitted_tokens: list[list[int]] = []
        accepted: list[int] = []
        for i, row in enumerate(rows):
            tokens: list[int] = []
            for j in range(k + 1):
                p = None if row.greedy else self._probs(target[i, j], row)
                if j < k and self._accepts(
                    row, target[i, j], p, draft_probs[i], j, drafts[i][j], generators[i]
                ):
                    tokens.append(drafts[i][j])
                    continue
                if row.greedy:
                    tokens.append(int(target[i, j].argmax()))
                else:
                    assert p is not None
                    residual = (p - draft_probs[i][j]).clamp(min=0) if j < k else p
                    if float(residual.sum()) <= 0:  # p == q: any draw from p is exact
                        residual = p
                    tokens.append(int(torch.multinomial(residual, 1, generator=generators[i])))
                break
            emitted_tokens.append(tokens)
            accepted.append(len(tokens) - 1)
        emitted = []
        for j in range(k + 1):
            at = [i for i in range(count) if len(emitted_tokens[i]) > j]
            if not at:
                break
            choice = report_tokens(
                reported_logits[at, j],
                torch.tensor([emitted_tokens[i][j] for i in at]),
                [rows[i] for i in at],
                processed=processed,
            )
            emitted.append((at, choice))
        return SpeculativeStep(emitted, accepted, k)

    # ---- the two decisions a broken decoder gets wrong (the fault suite plants each) --------

    def _accepts(
        self,
        row: RowSampling,
        target_logits: torch.Tensor,
        p: torch.Tensor | None,
        draft_probs: list[torch.Tensor],
        j: int,
        token: int,
        generator: torch.Generator,
    ) -> bool:
        """Whether draft ``token`` at position ``j`` is accepted (see the module)."""
        if row.greedy:
            return token == int(target_logits.argmax())
        assert p is not None
        u = float(torch.rand((), generator=generator))
        return u * float(draft_probs[j][token]) < float(p[token])

    def _reported_logits(
        self,
        target: torch.Tensor,
        contexts: Sequence[Sequence[int]],
        drafts: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The logits ``[A, k + 1, V]`` emitted tokens are reported with: the target's."""
        return target

    @staticmethod
    def _probs(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
        """The row's processed distribution ``[V]`` of ``logits`` ``[V]``."""
        return processed_log_probs(logits[None], row.temperature, row.top_k, row.top_p, row.min_p)[
            0
        ].exp()
