"""``IncrementalText``: a streamed row's text deltas add up to the row's whole text, cut at the
first stop string, whatever chunks its tokens come in; each delta is decoded from the new
tokens only (a row's text costs the same per token at any length)."""

from __future__ import annotations

import itertools

import pytest
from gen_serve.codec import IncrementalText, TextCodec
from gen_testkit.models import build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

_TEXTS = st.text(alphabet="ab cdé€😀\n.", min_size=1, max_size=40)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_model_dir(build_tiny_model("tiny-qwen2").path)


def _stream(codec: TextCodec, ids: list[int], cuts: list[int], **kwargs: object) -> list[str]:
    text = IncrementalText(codec, **kwargs)  # type: ignore[arg-type]
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    deltas = [text.add(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*deltas, text.add([], final=True)]


@settings(deadline=None, max_examples=60)
@given(words=_TEXTS, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_the_deltas_add_up_to_the_rows_text_and_never_split_a_character(codec, words, cuts):
    ids = codec.encode(words, add_special_tokens=False)
    deltas = _stream(codec, ids, cuts)
    assert "".join(deltas) == codec.decode(ids)
    assert all("\ufffd" not in d for d in deltas[:-1]), deltas


@settings(deadline=None, max_examples=60)
@given(
    words=_TEXTS,
    stop=st.sampled_from(["é", "cd", "\n.", "😀"]),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_text_stops_before_the_first_stop_string_and_never_shows_part_of_one(
    codec, words, stop, cuts
):
    ids = codec.encode(words, add_special_tokens=False)
    whole = codec.decode(ids)
    deltas = _stream(codec, ids, cuts, stop_strings=[stop])
    expected = whole[: whole.find(stop)] if stop in whole else whole
    assert "".join(deltas) == expected
    sent = ""
    for delta in deltas[:-1]:
        sent += delta
        assert stop not in sent


def test_each_add_decodes_only_the_new_tokens(codec):
    decoded: list[int] = []

    class Counting(TextCodec):
        def decode(self, ids, *, skip_special_tokens=True):  # type: ignore[override]
            decoded.append(len(ids))
            return super().decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting.__new__(Counting)
    counting.__dict__.update(codec.__dict__)
    text = IncrementalText(counting)
    ids = codec.encode("abcd " * 200, add_special_tokens=False)
    for token in ids:
        text.add([token])
    assert max(decoded) <= 8, f"a decode of {max(decoded)} ids for one new token"
    assert text.sent == codec.decode(ids)
