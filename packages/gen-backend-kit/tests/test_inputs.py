import pytest
import torch
from gen_backend_kit import normalize_generation_input
from gen_interface import GenerationInputError
from gen_testkit.bad_inputs import BAD_INPUTS
from gen_testkit.strategies import PADDINGS, pad_prompts, prompts
from hypothesis import given
from hypothesis import strategies as st

VOCAB = 100


@given(rows=prompts(VOCAB, max_rows=8), data=st.data())
def test_every_padding_layout_normalises_to_the_same_rows(rows, data):
    offsets = data.draw(st.lists(st.integers(0, 4), min_size=len(rows), max_size=len(rows)))
    extra = data.draw(st.integers(0, 3))
    seen = []
    for padding in PADDINGS:
        needed = max(len(r) + (o if padding == "mixed" else 0) for r, o in zip(rows, offsets))
        batch = pad_prompts(rows, padding, pad_token_id=7, width=needed + extra, offsets=offsets)
        normal = normalize_generation_input(batch, pad_token_id=0, vocab_size=VOCAB)
        assert normal.prompts() == rows
        assert normal.input_lengths.tolist() == [len(r) for r in rows]
        seen.append(normal.input_ids)
    for other in seen[1:]:
        assert torch.equal(seen[0], other)
    # canonical form: left-aligned, padded with the given pad id, as wide as the longest row
    assert seen[0].shape[1] == max(len(r) for r in rows)
    assert all(int(x) == 0 for row, r in zip(seen[0], rows) for x in row[len(r) :])


@pytest.mark.parametrize("problem", sorted(BAD_INPUTS))
def test_malformed_input_is_refused_with_a_message_naming_the_field(problem):
    with pytest.raises(GenerationInputError) as refused:
        normalize_generation_input(BAD_INPUTS[problem](VOCAB), pad_token_id=0, vocab_size=VOCAB)
    message = str(refused.value)
    named = [
        f
        for f in (
            "input_ids",
            "attention_mask",
            "input_lengths",
            "stop_strings",
            "sample_seeds",
            "session_ids",
        )
        if f in message
    ]
    assert named, f"{problem}: message names no field: {message}"


def test_messages_name_the_row_and_value():
    batch = BAD_INPUTS["token id at the vocabulary size"](VOCAB)
    with pytest.raises(GenerationInputError, match=r"row 0 holds token id 100"):
        normalize_generation_input(batch, pad_token_id=0, vocab_size=VOCAB)
    with pytest.raises(GenerationInputError, match=r"attention_mask row 0 is \[1, 0, 1, 0\]"):
        normalize_generation_input(
            BAD_INPUTS["attention_mask row is not contiguous"](VOCAB), pad_token_id=0
        )


def test_prompts_that_fill_the_context_are_refused():
    batch = pad_prompts([[1, 2, 3], [4]], "right")
    with pytest.raises(GenerationInputError, match="row 0 has a 3-token prompt"):
        normalize_generation_input(batch, pad_token_id=0, context_limit=3)
    assert normalize_generation_input(batch, pad_token_id=0, context_limit=4).size == 2


def test_optional_fields_pass_through():
    batch = pad_prompts([[1, 2], [3]], "left")
    batch["stop_strings"] = [["x"], None]
    batch["sample_seeds"] = torch.tensor([5, 6])
    batch["session_ids"] = ["conversation-1", None]
    normal = normalize_generation_input(batch, pad_token_id=0)
    assert normal.stop_strings == [["x"], None]
    assert normal.sample_seeds.tolist() == [5, 6]
    assert normal.session_ids == ["conversation-1", None]
    assert normal.select([1, 0]).session_ids == [None, "conversation-1"]


def test_empty_batch_normalises():
    batch = {
        "input_ids": torch.zeros((0, 4), dtype=torch.int64),
        "attention_mask": torch.zeros((0, 4), dtype=torch.int64),
    }
    normal = normalize_generation_input(batch, pad_token_id=0, vocab_size=VOCAB)
    assert normal.size == 0 and normal.prompts() == []
