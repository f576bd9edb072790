"""``TextCodec``: text to token ids and back, and chat templates, from a model directory.

The server reads the model's ``tokenizer.json`` with the ``tokenizers`` library and its
``tokenizer_config.json`` (special tokens, the chat template, or ``chat_template.jinja``), so it
needs no backend and no transformers. Chat templates render in a sandboxed jinja2 environment
with the helpers Hugging Face templates use (``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplateError", "IncrementalText", "TextCodec"]

_REPLACEMENT = "\ufffd"  # what decoding an unfinished UTF-8 sequence ends in
_UTF8_CONTEXT = 4  # tokens before one that can hold the rest of its character


class ChatTemplateError(ValueError):
    """A chat request that the model's template cannot render (or there is no template)."""


@dataclass
class TextCodec:
    """A model's tokenizer, special tokens and chat template.

    Attributes:
        tokenizer: a ``tokenizers.Tokenizer``.
        eos_token_id, bos_token_id, pad_token_id: the special tokens' ids (None if absent).
        chat_template: the jinja2 source, or None.
        special_tokens: the text of every special token (for templates and ``decode``).
    """

    tokenizer: Any
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_model_dir(cls, model: str | Path) -> TextCodec:
        """Load from a Hugging Face model directory.

        Raises:
            FileNotFoundError: the directory has no ``tokenizer.json``.
        """
        from tokenizers import Tokenizer

        root = Path(model)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{root} has no tokenizer.json: the server needs the model's fast tokenizer to "
                "turn text into ids (token-id prompts need none, but text and chat do)"
            )
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            config = json.loads((root / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        specials: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(key))
            if text:
                specials[key] = text
        return cls(
            tokenizer=tokenizer,
            eos_token_id=_id_of(tokenizer, specials.get("eos_token")),
            bos_token_id=_id_of(tokenizer, specials.get("bos_token")),
            pad_token_id=_id_of(tokenizer, specials.get("pad_token")),
            chat_template=template,
            special_tokens=specials,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens included), for logprob entries."""
        return self.decode([token_id], skip_special_tokens=False)

    def logprob_text(self, token_id: int, context: Sequence[int] = ()) -> str:
        """A token's text in logprob entries, as vLLM's engine writes it: the token decoded
        alone, with the leading spaces a SentencePiece decode strips put back; a token that
        ends in an unfinished UTF-8 sequence (byte fallback) is decoded after up to 4 of the
        sampled tokens before it (``context``, oldest first), and is ``""`` while its bytes
        stay unfinished."""
        text = self._restored(token_id, self.token_text(token_id))
        if not text.endswith(_REPLACEMENT):
            return text
        recent = list(context)[-_UTF8_CONTEXT:]
        for n in range(1, len(recent) + 1):
            before = recent[-n:]
            full = self.decode([*before, token_id], skip_special_tokens=False)
            if full.endswith(_REPLACEMENT):
                continue
            # Context tokens that are themselves unfinished bytes belong to this character.
            clean = len(before)
            while clean and self.token_text(before[clean - 1]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = self.decode(before[:clean], skip_special_tokens=False) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = next(
                (i for i, (a, b) in enumerate(zip(prefix, full)) if a != b),
                min(len(prefix), len(full)),
            )
            return full[common:]
        return ""

    def _restored(self, token_id: int, text: str) -> str:
        marker = self._space_marker
        if marker is None:
            return text
        piece = self.token_piece(token_id)
        markers = len(piece) - len(piece.lstrip(marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    @functools.cached_property
    def _space_marker(self) -> str | None:
        """The Metaspace pre-tokenizer's replacement character (SentencePiece models), whose
        leading instance ``decode`` strips; None for byte-level and other tokenizers."""
        try:
            pre = json.loads(self.tokenizer.to_str()).get("pre_tokenizer") or {}
        except (AttributeError, ValueError):
            return None
        for sub in [pre, *pre.get("pretokenizers", [])]:
            if isinstance(sub, dict) and sub.get("type") == "Metaspace":
                return str(sub.get("replacement", "\u2581"))
        return None

    def token_piece(self, token_id: int) -> str:
        """The tokenizer's own piece for a token (e.g. ``Ġhello``)."""
        piece = self.tokenizer.id_to_token(token_id)
        return piece if piece is not None else ""

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The model's chat template applied to ``messages``.

        Raises:
            ChatTemplateError: there is no template, or it refuses the messages.
        """
        if not self.chat_template:
            raise ChatTemplateError(
                "the model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja): use /v1/completions with a prompt"
            )
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"the chat template refused the messages: {message}")

        def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            text = env.from_string(self.chat_template).render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **dict(extra or {}),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
        if continue_final_message and messages:
            last = str(messages[-1].get("content") or "")
            end = text.rfind(last)
            if last and end >= 0:
                text = text[: end + len(last)]
        return text


class IncrementalText:
    """A row's text as its tokens come, handed out as deltas that never split a character nor
    show part of a stop string that may yet end the row.

    A token may end inside a multi-byte character; its text then ends in U+FFFD until the next
    token completes it, so such a tail is held back, as is any tail that could begin one of the
    ``stop_strings`` (cut from the text unless ``include_stop``).

    Each ``add`` costs the same whatever the row's length: only the tokens since the text last
    grew are decoded (with the chunk before them as context, so a tokenizer that writes a
    token's leading space by context writes the same text as it would for the whole row; vLLM's
    incremental detokenizer does the same), and stop strings are looked for in the new text and
    the few characters before it only.
    """

    def __init__(
        self,
        codec: TextCodec,
        *,
        skip_special_tokens: bool = True,
        stop_strings: Sequence[str] = (),
        include_stop: bool = False,
    ):
        self._codec = codec
        self._skip = skip_special_tokens
        self._stops = [] if include_stop else list(stop_strings)
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._ids: list[int] = []
        self._context = 0  # the ids from here to ``_read`` are the last chunk decoded: context
        self._read = 0  # ids before this are in ``_text``
        self._text = ""  # the text of every id before ``_read``
        self._cut: int | None = None  # where a stop string begins, once one appeared
        self.sent = ""

    def add(self, ids: Sequence[int], *, final: bool = False) -> str:
        """Take new token ids; the text that can be sent now (all of it when ``final``)."""
        self._ids.extend(ids)
        if self._cut is None:
            self._decode_new(final)
            self._find_stop()
        if self._cut is not None:
            text = self._text[: self._cut]
        elif final:
            text = self._text
        else:
            hold = self._longest - 1 if self._longest else 0
            text = self._text[: max(len(self.sent), len(self._text) - hold)]
        delta = text[len(self.sent) :]
        self.sent += delta
        return delta

    def _decode_new(self, final: bool) -> None:
        """Append the text of the ids past ``_read``, unless it ends inside a character."""
        if self._read == len(self._ids):
            return
        before = self._codec.decode(
            self._ids[self._context : self._read], skip_special_tokens=self._skip
        )
        after = self._codec.decode(self._ids[self._context :], skip_special_tokens=self._skip)
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self._text += after[len(before) :]
            self._context, self._read = self._read, len(self._ids)

    def _find_stop(self) -> None:
        """Where the first stop string begins, looked for where a new one could be."""
        if not self._stops:
            return
        start = max(0, len(self.sent) - self._longest)
        found = [at for stop in self._stops if (at := self._text.find(stop, start)) >= 0]
        if found:
            self._cut = min(found)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _id_of(tokenizer: Any, text: str | None) -> int | None:
    if text is None:
        return None
    found = tokenizer.token_to_id(text)
    return int(found) if found is not None else None
