"""The logit processor SGLang servers apply for rows in ``"processed"`` logprobs mode.

It runs inside the server (``support_dir`` puts it on the path), before SGLang's sampler. Each
row's logits become ``gen_interface.sampling.processed_log_probs`` of them: temperature, min-p,
top-k and top-p, in the order and with the tie rules every backend of this project samples
with. The request then asks SGLang for temperature 1 and no filters of its own, so SGLang
samples from exactly that distribution and reports its log-probabilities: the processed
logprobs, which SGLang's own sampler does not report (its logprobs are tempered, not filtered).

A row's ``custom_params``: ``{"temperature": float, "top_k": int | None, "top_p": float,
"min_p": float}``.
"""

from __future__ import annotations

from typing import Any

import torch
from gen_interface.sampling import processed_log_probs
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ProcessedLogits(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        rows = custom_param_list or []
        filtered = processed_log_probs(
            logits,
            torch.tensor([float(r["temperature"]) for r in rows]),
            [r.get("top_k") for r in rows],
            torch.tensor([float(r["top_p"]) for r in rows]),
            torch.tensor([float(r["min_p"]) for r in rows]),
        )
        return filtered.to(device=logits.device, dtype=logits.dtype)
