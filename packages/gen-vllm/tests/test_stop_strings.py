"""Stop strings end to end: vLLM loads the tiny model's real tokenizer and stops where the
Hugging Face reference stops, right after the token that completes the string."""

import pytest
from gen_hf import HfGeneration
from gen_testkit.config_checks import for_backend
from gen_testkit.strategies import pad_prompts
from transformers import AutoTokenizer

PROMPTS = [[5, 17, 42, 8], [99, 100], [7, 7, 7], [300, 12, 1], [250], [61, 62, 63, 64]]


@pytest.fixture(scope="module")
def pair(engines, tiny_qwen2):
    vllm = engines.get(tiny_qwen2, replicas=1).with_sampling(max_new_tokens=16, stop_token_ids=[])
    hf = HfGeneration(for_backend(vllm.config, "hf"))
    yield vllm, hf
    hf.shutdown()


def test_both_backends_stop_right_after_the_completing_token(pair, tiny_qwen2):
    vllm, hf = pair
    assert vllm.capabilities.stop_strings and hf.capabilities.stop_strings
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2.path)
    batch = pad_prompts(PROMPTS, "left")
    free = vllm.generate(batch, greedy=True)
    generated = [
        free["output_ids"][i, len(p) : int(free["unpadded_sequence_lengths"][i])].tolist()
        for i, p in enumerate(PROMPTS)
    ]
    row = max(range(len(PROMPTS)), key=lambda i: len(tokenizer.decode(generated[i])))
    text = tokenizer.decode(generated[row])
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle
    assert stop.strip(), f"the continuation {text!r} has no text to stop on"
    expected = next(
        generated[row][:n] for n in range(1, 17) if stop in tokenizer.decode(generated[row][:n])
    )
    outputs = [b.with_sampling(stop_strings=[stop]).generate(batch, greedy=True) for b in pair]
    for out in outputs:
        length = int(out["unpadded_sequence_lengths"][row])
        got = out["output_ids"][row, len(PROMPTS[row]) : length].tolist()
        assert got == expected, f"stopped at {tokenizer.decode(got)!r}, stop string {stop!r}"
        assert not bool(out["truncated"][row])
    assert outputs[0]["output_ids"].tolist() == outputs[1]["output_ids"].tolist()
