"""``gen_vllm.seeded_drafts``: a seeded row's probabilistic drafts come from its own generator;
everything else is vLLM's ``compute_probs_and_sample_next_token``."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from gen_vllm.seeded_drafts import seed_draft_sampling, seeded_sample

V = 50


def _metadata(temperature, generators, *, all_greedy=False, all_random=True):
    return SimpleNamespace(
        temperature=torch.tensor(temperature),
        generators=generators,
        all_greedy=all_greedy,
        all_random=all_random,
    )


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(3))


def test_a_seeded_row_draws_the_same_drafts_whatever_the_global_stream_and_its_batch_mates():
    def draw(global_seed: int, mates: int) -> list[int]:
        torch.manual_seed(global_seed)
        out = []
        generator = torch.Generator().manual_seed(7)
        for _ in range(5):  # five draft positions of one step
            logits = torch.cat([_logits(1), torch.randn(mates, V)])
            meta = _metadata([0.9] * (1 + mates), {0: generator})
            out.append(int(seeded_sample(logits, meta)[0][0]))
        return out

    first = draw(0, 3)
    assert first == draw(1, 3) == draw(2, 0)
    assert len(set(first)) > 1  # drawn, not argmax


def test_unseeded_rows_follow_the_global_stream_and_the_probabilities_are_the_tempered_softmax():
    logits = _logits(4)
    expected = (logits / torch.tensor([[0.5], [1.0], [1.5], [2.0]])).softmax(-1)
    torch.manual_seed(11)
    tokens, probs = seeded_sample(logits.clone(), _metadata([0.5, 1.0, 1.5, 2.0], {}))
    torch.manual_seed(11)
    again, _ = seeded_sample(logits.clone(), _metadata([0.5, 1.0, 1.5, 2.0], {}))
    assert torch.allclose(probs, expected, atol=1e-6)
    assert torch.equal(tokens, again)


def test_greedy_rows_take_their_argmax():
    logits = _logits(3)
    meta = _metadata([0.0, 1.0, 0.0], {}, all_random=False)
    tokens, _ = seeded_sample(logits.clone(), meta)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    all_greedy, probs = seeded_sample(logits.clone(), _metadata([0.0] * 3, {}, all_greedy=True))
    assert torch.equal(all_greedy, logits.argmax(-1)) and torch.equal(probs, logits)


def test_vllm_s_draft_sampling_is_replaced():
    from vllm.v1.spec_decode import llm_base_proposer

    assert seed_draft_sampling()
    assert llm_base_proposer.compute_probs_and_sample_next_token is seeded_sample
