"""``batch_invariant: true`` in gen-hf: the model runs gen-interface's batch-invariant kernels.

The kernels are the trainer's (``gen_interface.exact``), so the logprobs gen-hf returns equal
``gen_interface.exact.sequence_logprobs`` of the same tokens bit for bit: prefill and decode,
left-padded groups of any size, and ``score``'s right-padded batches all reduce every row in the
same order. They are checked on this machine before the backend accepts the setting.
"""

from __future__ import annotations

import torch
from gen_interface import BackendUnavailableError
from gen_interface.exact import batch_invariance_problems, make_batch_invariant

__all__ = ["use_batch_invariant_kernels"]


def use_batch_invariant_kernels(model: torch.nn.Module) -> None:
    """Switch ``model`` to the batch-invariant kernels, after checking they hold here.

    Raises:
        BackendUnavailableError: this machine's kernels are not batch invariant for one of the
            model's shapes (named), or the model cannot take a registered attention function.
    """
    problems = batch_invariance_problems(model)
    if problems:
        raise BackendUnavailableError(
            "batch_invariant is true but on this machine these pieces of the model give a row "
            "different bits in different batches: " + "; ".join(problems) + ". Set "
            "batch_invariant to false, or report the CPU and torch version"
        )
    try:
        make_batch_invariant(model)
    except ValueError as exc:
        raise BackendUnavailableError(f"batch_invariant is true but {exc}") from exc
