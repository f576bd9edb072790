"""When a row stops: the CONTRACT's stopping rules, shared by every backend that decodes itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gen_backend_kit.row_sampling import BatchSampling

__all__ = ["StopReason", "StopRules"]

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopRules:
    """The stopping rules of one generate call, per row.

    A row stops right after a token in its ``stop_token_ids`` (kept), after its generated text
    first contains one of its stop strings (the completing token kept), after its
    ``max_new_tokens``, or when its full sequence reaches ``context_limit``. The first two are
    stops; the last two are truncations.

    Attributes:
        stop_token_ids: per row, the ids that end it.
        max_new_tokens: per row, the most tokens it generates.
        context_limit: the longest full sequence (prompt + generated), or None.
        stop_strings: per row, the strings that end it.
        decode: token ids -> text; needed only when some row has stop strings.
    """

    stop_token_ids: Sequence[frozenset[int]]
    max_new_tokens: Sequence[int]
    context_limit: int | None = None
    stop_strings: Sequence[Sequence[str]] = ()
    decode: Callable[[list[int]], str] | None = None

    @classmethod
    def for_call(
        cls,
        sampling: BatchSampling,
        *,
        context_limit: int | None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> StopRules:
        """The rules of one call, from its resolved sampling."""
        return cls(
            stop_token_ids=[frozenset(row.stop_token_ids) for row in sampling.rows],
            max_new_tokens=[row.max_new_tokens for row in sampling.rows],
            context_limit=context_limit,
            stop_strings=[row.stop_strings for row in sampling.rows],
            decode=decode,
        )

    def reason(self, row: int, prompt_length: int, generated: list[int]) -> StopReason | None:
        """Why ``row`` stops after its latest token in ``generated``, or None to go on."""
        if generated[-1] in self.stop_token_ids[row] or self._stop_string_hit(row, generated):
            return "stop"
        if len(generated) >= self.max_new_tokens[row]:
            return "length"
        if self.context_limit is not None and prompt_length + len(generated) >= self.context_limit:
            return "length"
        return None

    def _stop_string_hit(self, row: int, generated: list[int]) -> bool:
        strings = self.stop_strings[row] if self.stop_strings else ()
        if not strings:
            return False
        if self.decode is None:
            raise ValueError("stop strings need a decode function (a tokenizer)")
        text = self.decode(generated)
        return any(s in text for s in strings)
