"""Batch-invariant ("exact") transformers models: rollout logprobs equal to the trainer's.

gen-interface holds the kernels (``gen_hf.exact``: plain torch); this package puts a
transformers model on them, for gen-hf's ``batch_invariant: true`` and for the trainer's own
model alike. A trainer imports it without a serving stack: gen-hf needs only gen-interface and
transformers.
"""

from gen_hf.exact.check import batch_invariance_problems
from gen_hf.exact.kernels import MIN_ROWS, SLOT_BLOCK, invariant_attention, invariant_linear
from gen_hf.exact.logprobs import sequence_logprobs
from gen_hf.exact.models import (
    ATTENTION_NAME,
    batch_invariant,
    make_batch_invariant,
    restore_model,
    use_batch_invariant_kernels,
)

__all__ = [
    "ATTENTION_NAME",
    "MIN_ROWS",
    "SLOT_BLOCK",
    "batch_invariance_problems",
    "batch_invariant",
    "invariant_attention",
    "invariant_linear",
    "make_batch_invariant",
    "restore_model",
    "sequence_logprobs",
    "use_batch_invariant_kernels",
]
