"""Batch-invariant ("exact") kernels: a row's bits never depend on its batch mates.

Plain torch. gen-hf's ``gen_hf.exact`` puts a transformers model on them (and computes the
trainer's ``sequence_logprobs``); ``batch_invariance_problems`` checks a model on this machine.
"""

from gen_interface.exact.check import batch_invariance_problems
from gen_interface.exact.kernels import (
    MIN_ROWS,
    SLOT_BLOCK,
    invariant_attention,
    invariant_linear,
)

__all__ = [
    "MIN_ROWS",
    "SLOT_BLOCK",
    "batch_invariance_problems",
    "invariant_attention",
    "invariant_linear",
]
