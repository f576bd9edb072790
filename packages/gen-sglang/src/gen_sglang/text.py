"""``SglangTextCodec``: the server's tokenizer, through SGLang's ``/tokenize`` and
``/detokenize``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SglangTextCodec"]


class SglangTextCodec:
    """Text to token ids and back on a server (``gen_backend_kit.text.TextCodec``): special
    tokens added on the way in, skipped on the way out, as the other backends do.

    Args:
        post: ``post(route, body)`` on one of the backend's servers, the parsed answer back.
    """

    def __init__(self, post: Callable[[str, dict[str, Any]], Any]):
        self.post = post

    def encode(self, text: str) -> list[int]:
        answer = self.post("/tokenize", {"prompt": text, "add_special_tokens": True})
        return [int(t) for t in answer["tokens"]]

    def decode(self, token_ids: list[int]) -> str:
        answer = self.post("/detokenize", {"tokens": list(token_ids), "skip_special_tokens": True})
        return str(answer["text"])
