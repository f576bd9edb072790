"""Batch-invariant ("exact") forward passes: rollout logprobs equal to the trainer's, bitwise."""

from gen_interface.exact.check import batch_invariance_problems
from gen_interface.exact.kernels import (
    MIN_ROWS,
    SLOT_BLOCK,
    invariant_attention,
    invariant_linear,
)
from gen_interface.exact.logprobs import sequence_logprobs
from gen_interface.exact.transformers_models import (
    ATTENTION_NAME,
    batch_invariant,
    make_batch_invariant,
    restore_model,
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
]
