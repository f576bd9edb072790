"""The output projection in float32 (``lm_head_fp32``) in a bfloat16 or float16 model.

The model is read in float32 and its body then cast to the model's dtype, so the head keeps its
checkpoint's float32 values (a head tied to the embeddings stays in the model's dtype, shared
with them, and is cast as it is applied). The head's ``forward`` is replaced on the module
itself, so its parameter keeps its name: weight updates write it as before (cast to float32).
Its logits come out in float32, and every log-softmax of this backend runs on float32 logits.
"""

from __future__ import annotations

import types

import torch
from gen_interface import GenerationConfigError

__all__ = ["load_dtype_for", "use_float32_head"]


def load_dtype_for(dtype: str | torch.dtype, float32_head: bool) -> str | torch.dtype:
    """The dtype to read the checkpoint in: float32 when a float32 head is wanted in a
    half-precision model (its body is cast after), else ``dtype`` itself."""
    half = dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if float32_head and half else dtype


def use_float32_head(model: torch.nn.Module, dtype: str | torch.dtype) -> None:
    """Cast ``model``'s parameters to ``dtype`` (unless ``"auto"``; buffers as they were
    loaded, as a model read in ``dtype`` has them), keep its untied head in float32,
    and make the head compute ``hidden.float() @ weight.float().T`` (+ bias).

    Raises:
        GenerationConfigError: the model has no linear output projection to run in float32.
    """
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, torch.nn.Linear):
        raise GenerationConfigError(
            f"lm_head_fp32 needs a linear output projection, and {type(model).__name__}'s is "
            f"{type(head).__name__}; set lm_head_fp32 to false"
        )
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    tied = head.weight is getattr(embeddings, "weight", None)
    if dtype != "auto":
        for parameter in model.parameters():  # buffers (rotary frequencies) keep their dtype
            if parameter is not head.weight or tied:
                parameter.data = parameter.data.to(dtype)

    def forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)

    head.forward = types.MethodType(forward, head)  # type: ignore[method-assign]
