"""Text in, text out: NeMo RL's ``generate_text``, through the backend's tokenizer.

The generation path itself stays token ids only; this is a thin layer over ``generate`` for
evaluation loops that hold strings: the prompts are tokenised as the engine would tokenise a text
prompt (special tokens added), generated, and each row's new tokens decoded without special
tokens, a stop string included (vLLM's ``include_stop_str_in_output``, as NeMo RL sets it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.errors import GenerationError, GenerationInputError

if TYPE_CHECKING:
    from gen_interface.interface import GenerationInterface

__all__ = ["HfTokenizerCodec", "TextCodec", "generate_text"]


class TextCodec(Protocol):
    """Text to token ids and back."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class HfTokenizerCodec:
    """A ``TextCodec`` over a Hugging Face tokenizer (anything with its ``encode`` /
    ``decode``): special tokens added on the way in, skipped on the way out, as vLLM does."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=True)]

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))


def generate_text(
    backend: GenerationInterface,
    codec: TextCodec | None,
    data: Mapping[str, Any],
    greedy: bool = False,
) -> BatchedDataDict[Any]:
    """``{"prompts": [str, ...]}`` (optionally ``"stop_strings"``, a list per row) in,
    ``{"texts": [str, ...]}`` out, one text per prompt, in order.

    Raises:
        GenerationError: ``codec`` is None (the backend has no tokenizer).
        GenerationInputError: no ``prompts``, or not a list of strings.
    """
    if codec is None:
        raise GenerationError(
            f"generate_text needs a tokenizer and this {type(backend).__name__} has none "
            f"(model {backend.config.get('model_name')!r}): tokenise the prompts and call generate"
        )
    prompts = data.get("prompts")
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        raise GenerationInputError(
            "generate_text takes {'prompts': [str, ...]} (a non-empty list of strings), got "
            f"{type(prompts).__name__}"
        )
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise GenerationInputError(f"generate_text: prompts {bad[:5]} are not strings")
    ids = [codec.encode(p) for p in prompts]
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:
        raise GenerationInputError(f"generate_text: prompts {empty[:5]} tokenise to no tokens")
    width = max(len(row) for row in ids)
    pad = int(backend.config["pad_token_id"])
    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.tensor([row + [pad] * (width - len(row)) for row in ids]),
        input_lengths=torch.tensor([len(row) for row in ids]),
    )
    if "stop_strings" in data:
        batch["stop_strings"] = list(data["stop_strings"])
    out = backend.generate(batch, greedy=greedy)
    texts = []
    for row, prompt in enumerate(ids):
        start = len(prompt)
        generated = out["output_ids"][row, start : start + int(out["generation_lengths"][row])]
        texts.append(codec.decode(generated.tolist()))
    return BatchedDataDict(texts=texts)
