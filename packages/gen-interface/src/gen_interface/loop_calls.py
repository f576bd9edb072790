"""What a training loop calls beside generation, the same on every backend: ``generate_text``
through the backend's tokenizer, and the logger metrics the base counts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.metrics import GenerationMetrics
from gen_interface.text import TextCodec, generate_text

__all__ = ["LoopCalls"]


class LoopCalls:
    """``GenerationBackend``'s ``generate_text``, ``get_logger_metrics`` and
    ``clear_logger_metrics``, with the two steps a backend may add."""

    _metrics: GenerationMetrics

    def generate_text(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        return generate_text(self, self._text_codec(), data, greedy)  # type: ignore[arg-type]

    def get_logger_metrics(self) -> dict[str, int | float]:
        return self._metrics.snapshot(self._extra_metrics())

    def clear_logger_metrics(self) -> None:
        self._metrics.clear()
        self._extra_metrics(clear=True)

    def _text_codec(self) -> TextCodec | None:
        """The tokenizer ``generate_text`` goes through (None: it is refused)."""
        return None

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        """The backend's own metrics since the last clear (``clear``: start them anew)."""
        return {}
