"""``GenerationBackend``: the shared body every backend stands on, tested on minimal backends."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gen_backend_kit import GenerationBackend, RowResult
from gen_backend_kit.lifecycle import close_all
from gen_interface import BackendBrokenError, GenerationConfigError, GenerationError
from gen_testkit.strategies import pad_prompts

CONFIG = {
    "backend": "toy",
    "model_name": "toy",
    "max_new_tokens": 3,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "stop_token_ids": [],
    "stop_strings": None,
    "pad_token_id": 0,
    "logprobs_mode": "raw",
    "seed": 0,
    "dtype": "auto",
    "colocated": {"enabled": False},
    "max_weight_staleness": None,
}


class Toy(GenerationBackend):
    """Each row: its prompt's first token, repeated ``max_new_tokens`` times; ``drop`` rows lost."""

    def __init__(self, drop=(), fail: BaseException | None = None):
        self.drop, self.fail, self.calls = set(drop), fail, 0
        super().__init__(
            self.complete_config(CONFIG),
            vocab_size=100,
            context_limit=None,
            has_tokenizer=False,
            model_specs=None,
        )

    def _run_rows(self, call, control):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return [
            None
            if i in self.drop
            else control.finished(
                i,
                RowResult.ended("length", [p[0]] * row.max_new_tokens, [-1.0] * row.max_new_tokens),
            )
            for i, (p, row) in enumerate(zip(call.prompts.prompts(), call.sampling.rows))
        ]


BATCH = pad_prompts([[5, 6], [7], [9, 9, 9]], "left")


def test_rows_a_backend_loses_are_an_error_naming_them():
    """Before the base: gen-vllm dropped missing rows and a plain ValueError followed."""
    with pytest.raises(GenerationError, match=r"no result for 1 of 3 rows \(rows \[1\]\)"):
        Toy(drop={1}).generate(BATCH)

    async def stream():
        return [i async for i, _ in Toy(drop={2}).generate_async(BATCH)]

    with pytest.raises(GenerationError, match=r"rows \[2\]"):
        asyncio.run(stream())


def test_the_default_stream_hands_over_every_row_as_generate_gives_it():
    backend = Toy()

    async def stream():
        return {i: row async for i, row in backend.generate_async(BATCH)}

    rows = asyncio.run(stream())
    whole = backend.generate(BATCH)
    assert sorted(rows) == [0, 1, 2]
    for i, row in rows.items():
        width = int(whole["unpadded_sequence_lengths"][i])
        assert torch.equal(row["output_ids"][0], whole["output_ids"][i, :width])


def test_a_fatal_error_breaks_the_backend_and_every_later_call_says_why():
    backend = Toy(fail=BackendBrokenError("replica 1's engine died"))
    with pytest.raises(BackendBrokenError):
        backend.generate(BATCH)
    backend.fail = None
    with pytest.raises(GenerationError, match=r"broken \(replica 1's engine died"):
        backend.generate(BATCH)
    with pytest.raises(GenerationError, match="broken"):
        backend.prepare_for_generation()
    backend.shutdown()


def test_an_ordinary_error_leaves_the_backend_usable():
    backend = Toy(fail=GenerationError("one call failed"))
    with pytest.raises(GenerationError, match="one call failed"):
        backend.generate(BATCH)
    backend.fail = None
    assert backend.generate(BATCH).size == 3


def test_front_ends_resolve_their_own_sampling_and_close_alone():
    backend = Toy()
    short = backend.with_sampling(max_new_tokens=1)
    assert short.generate(BATCH)["generation_lengths"].tolist() == [1, 1, 1]
    assert backend.generate(BATCH)["generation_lengths"].tolist() == [3, 3, 3]
    with pytest.raises(GenerationConfigError, match="per call"):
        backend.with_sampling(dtype="float32")
    with pytest.raises(GenerationConfigError, match="tokenizer"):
        backend.with_sampling(stop_strings=["x"])
    short.shutdown()
    with pytest.raises(GenerationError, match="front end"):
        short.generate(BATCH)
    assert backend.generate(BATCH).size == 3


def test_capabilities_a_backend_lacks_raise_not_implemented_naming_them():
    backend = Toy()
    with pytest.raises(NotImplementedError, match="score"):
        backend.score({})
    with pytest.raises(NotImplementedError, match="update_weights_from_ipc_handles"):
        backend.update_weights_from_ipc_handles({})
    with pytest.raises(NotImplementedError, match="start_weight_update"):
        backend.start_weight_update()
    assert backend.weight_version == 0


def test_every_shutdown_step_runs_even_when_one_fails():
    ran = []

    def fails():
        ran.append("engines")
        raise RuntimeError("an engine would not stop")

    with pytest.raises(GenerationError, match="engines: RuntimeError: an engine would not stop"):
        close_all("Toy", [("engines", fails), ("cluster", lambda: ran.append("cluster"))])
    assert ran == ["engines", "cluster"]
