"""``RemoteTextCodec``: the server's tokenizer, through its ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from gen_remote.wire import Wire

__all__ = ["RemoteTextCodec"]


class RemoteTextCodec:
    """Text to token ids and back on the server (``gen_backend_kit.text.TextCodec``): special
    tokens added on the way in and, on a gen-serve server, skipped on the way out."""

    def __init__(self, wire: Wire, dialect: str):
        self.wire = wire
        self.dialect = dialect

    def encode(self, text: str) -> list[int]:
        answer = self.wire.call("POST", "/tokenize", {"prompt": text, "add_special_tokens": True})
        return [int(t) for t in answer["tokens"]]

    def decode(self, token_ids: list[int]) -> str:
        body: dict[str, object] = {"tokens": list(token_ids)}
        if self.dialect == "gen-serve":
            body["skip_special_tokens"] = True
        return str(self.wire.call("POST", "/detokenize", body)["prompt"])
