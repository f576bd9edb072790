"""``RowEvent``: one row's progress in ``generate_stream``, token by token.

A row's events carry its tokens in order, each once: the concatenation of a row's ``token_ids``
over its events is the row's generated tokens, and its last event (``output`` set) carries the
row's one-row output, exactly what ``generate_async`` yields for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gen_interface.batched_data_dict import BatchedDataDict

__all__ = ["RowEvent"]


@dataclass(frozen=True)
class RowEvent:
    """New tokens of one row, and its output once it finished.

    Attributes:
        index: the row's index in the call's batch.
        token_ids: the tokens generated since the row's previous event (may be empty).
        logprobs: their log-probabilities, in the call's logprobs mode.
        topk_ids: per new token, the row's ``top_logprobs`` likeliest tokens (empty lists when
            the row asked for none).
        topk_logprobs: their logprobs.
        output: the row's one-row ``GenerationOutputSpec`` output when this is its last event,
            else None.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float]
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    output: BatchedDataDict[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None
