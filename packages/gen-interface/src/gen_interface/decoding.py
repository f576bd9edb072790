"""When a row stops: the CONTRACT's stopping rules, shared by every backend that decodes itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gen_interface.inputs import PromptBatch

__all__ = ["StopReason", "StopRules", "row_stop_strings"]

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopRules:
    """The stopping rules of one generate call.

    A row stops right after a token in ``stop_token_ids`` (kept), after its generated text first
    contains one of its stop strings (the completing token kept), after ``max_new_tokens``, or
    when its full sequence reaches ``context_limit``. The first two are stops; the last two are
    truncations.

    Attributes:
        stop_token_ids: ids that end a row.
        max_new_tokens: the most tokens a row generates.
        context_limit: the longest full sequence (prompt + generated), or None.
        stop_strings: per row, the strings that end it (config's plus the row's own), or None.
        decode: token ids -> text; needed only when some row has stop strings.
    """

    stop_token_ids: frozenset[int]
    max_new_tokens: int
    context_limit: int | None = None
    stop_strings: Sequence[Sequence[str] | None] | None = None
    decode: Callable[[list[int]], str] | None = None

    @classmethod
    def for_call(
        cls,
        config: Mapping[str, Any],
        prompts: PromptBatch,
        *,
        context_limit: int | None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> StopRules:
        """The rules for one call: the config's stop tokens and strings plus each row's strings."""
        return cls(
            stop_token_ids=frozenset(config.get("stop_token_ids") or ()),
            max_new_tokens=int(config["max_new_tokens"]),
            context_limit=context_limit,
            stop_strings=row_stop_strings(config, prompts),
            decode=decode,
        )

    def reason(self, row: int, prompt_length: int, generated: list[int]) -> StopReason | None:
        """Why ``row`` stops after its latest token in ``generated``, or None to go on."""
        if generated[-1] in self.stop_token_ids or self._stop_string_hit(row, generated):
            return "stop"
        if len(generated) >= self.max_new_tokens:
            return "length"
        if self.context_limit is not None and prompt_length + len(generated) >= self.context_limit:
            return "length"
        return None

    def _stop_string_hit(self, row: int, generated: list[int]) -> bool:
        strings = self.stop_strings[row] if self.stop_strings is not None else None
        if not strings:
            return False
        if self.decode is None:
            raise ValueError("stop strings need a decode function (a tokenizer)")
        text = self.decode(generated)
        return any(s in text for s in strings)


def row_stop_strings(config: Mapping[str, Any], prompts: PromptBatch) -> list[list[str]]:
    """Each row's stop strings: the config's, then the row's own, without repeats."""
    common = list(config.get("stop_strings") or [])
    return [list(dict.fromkeys(common + list(own or []))) for own in prompts.stop_strings]
