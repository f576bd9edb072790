"""A ``StepBatch``'s wire form (``gen_vllm.wire``) gives back exactly the batch it was made of."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from gen_vllm import wire
from gen_vllm.messages import RowFailure, RowOutput, StepBatch, TokenDelta
from hypothesis import given, settings
from hypothesis import strategies as st

_IDS = st.integers(min_value=0, max_value=2**40)
_LOGPROBS = st.floats(width=32, allow_nan=False, max_value=0.0)


@st.composite
def _tokens(draw: st.DrawFn, top: bool) -> dict[str, Any]:
    """One row's per-token fields: n tokens, and (where ``top``) k top logprobs per token."""
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(_IDS, min_size=n, max_size=n))
    logprobs = draw(st.lists(_LOGPROBS, min_size=n, max_size=n))
    fields: dict[str, Any] = {"token_ids": ids, "logprobs": logprobs}
    k = draw(st.integers(0, 3)) if top and n else None
    if k is not None:
        fields["topk_ids"] = [draw(st.lists(_IDS, min_size=k, max_size=k)) for _ in range(n)]
        fields["topk_logprobs"] = [
            draw(st.lists(_LOGPROBS, min_size=k, max_size=k)) for _ in range(n)
        ]
    return fields


@st.composite
def _row(draw: st.DrawFn) -> RowOutput:
    fields = draw(_tokens(top=draw(st.booleans())))
    n = len(fields["token_ids"])
    # a version per token, mostly one run, sometimes a refit midway (or a fake's none at all)
    first = draw(st.integers(0, 5))
    cut = draw(st.integers(0, n))
    versions = draw(st.sampled_from([[first] * cut + [first + 1] * (n - cut), []]))
    row = RowOutput(
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        weight_versions=versions,
        weight_version=first,
        cached_tokens=draw(st.integers(0, 9)),
        speculation=draw(st.tuples(*[st.integers(0, 9)] * 3)),
        **fields,
    )
    packable = "topk_ids" not in fields or len(fields["topk_ids"][0]) > 0  # packed() needs k > 0
    return row.packed() if packable and draw(st.booleans()) else row


@st.composite
def _delta(draw: st.DrawFn, index: int) -> TokenDelta:
    fields = draw(_tokens(top=draw(st.booleans())))
    return TokenDelta(
        f"d-{index}",
        fields["token_ids"],
        fields["logprobs"],
        fields.get("topk_ids", []),
        fields.get("topk_logprobs", []),
    )


@st.composite
def _batch(draw: st.DrawFn) -> StepBatch:
    deltas = [draw(_delta(i)) for i in range(draw(st.integers(0, 4)))]
    finished = [(f"f-{i}", draw(_row())) for i in range(draw(st.integers(0, 4)))]
    failed = [RowFailure("x-0", "gone", engine_failed=draw(st.booleans()))][
        : draw(st.integers(0, 1))
    ]
    return StepBatch(
        deltas, finished, failed, ended=1.5, steps=draw(st.integers(0, 3)), step_seconds=0.25
    )


def _plain(value: Any) -> Any:
    """Arrays as lists: the driver reads a row's fields through ``RowOutput.unpacked``."""
    return value.tolist() if isinstance(value, np.ndarray) else value


@settings(max_examples=200, deadline=None)
@given(batch=_batch())
def test_decode_gives_back_every_field_of_every_row(batch: StepBatch) -> None:
    back = wire.decode(wire.encode(batch))
    assert back.deltas == batch.deltas
    assert back.failed == batch.failed
    assert (back.ended, back.steps, back.step_seconds) == (1.5, batch.steps, 0.25)
    assert [i for i, _ in back.finished] == [i for i, _ in batch.finished]
    for (_, got), (_, sent) in zip(back.finished, batch.finished):
        assert got.unpacked() == sent.unpacked()
        # the packed form, as before: int64 ids and versions, float32 logprobs
        assert got.token_ids.dtype == np.int64 and got.logprobs.dtype == np.float32
        assert got.weight_versions.dtype == np.int64
        for name in ("topk_ids", "topk_logprobs"):
            assert (getattr(got, name) is None) == (_plain(getattr(sent, name)) is None)


def test_a_step_of_many_finished_rows_is_a_small_message() -> None:
    """256 rows of 128 tokens on one version: ids as int32, versions as one run, so the
    message is well under the 640 KiB that Ray's own serialisation of the packed rows took."""
    rows = [
        (f"r-{i}", RowOutput(list(range(128)), [-0.5] * 128, "length", [3] * 128, 3).packed())
        for i in range(256)
    ]
    batch = StepBatch(finished=rows)
    message = wire.encode(batch)
    tokens = 256 * 128
    assert len(message) < tokens * 8 + 128 * 256  # ids and logprobs, 4 bytes each; per row
    assert len(message) < len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)) * 0.7
    back = wire.decode(message)
    assert all(row.weight_versions.tolist() == [3] * 128 for _, row in back.finished)
