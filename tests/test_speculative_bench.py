"""``tools/bench/speculative.py``'s parts that need no engine: the break-even formula, the
synthetic task, the drafter-refit probe (on the n-gram reference decoder), and the directions
the RL step and the online distillation move the models in. (The bench's figures come from
running it; nothing here is timed.)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

import speculative as bench
from gen_interface import BatchedDataDict
from gen_interface.weights import Refitter
from speculative_models import MarkovTask

VOCAB = 512
END = bench.SCHEDULE_END


@pytest.mark.parametrize(
    ("speed_up", "acceptance", "k"), [(1.5, 0.8, 3), (0.9, 0.4, 3), (1.2, 0.7, 5)]
)
def test_break_even_is_where_speculation_neither_gains_nor_loses(speed_up, acceptance, k):
    cost = bench.verify_step_cost(speed_up, acceptance, k)
    assert (1 + k * acceptance) / cost == pytest.approx(speed_up)
    at_break_even = bench.break_even_acceptance(cost, k)
    assert (1 + k * at_break_even) / cost == pytest.approx(1.0)
    assert (at_break_even < acceptance) == (speed_up > 1)


def test_a_verifying_step_dearer_than_k_plus_one_plain_steps_never_pays():
    assert bench.break_even_acceptance(bench.verify_step_cost(0.9, 1.0, 3), 3) > 1


def test_a_step_without_drafts_has_a_cost_and_no_break_even():
    figure = bench.SpeedFigure(64, 64 * 48, [1.0, 1.2], [1.25, 1.5], [0.0, 0.0], [0.0, 0.0])
    summary = figure.summary(0)
    assert summary["ratio"] == pytest.approx(0.8)
    assert summary["verify_step_cost"] == pytest.approx(1.25)
    assert math.isnan(summary["break_even_acceptance"])


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ({3: {1: 1.5, 16: 1.1, 64: 0.96}, 0: {64: 0.98}}, [[1, 63, 3], [64, END, 0]]),
        (
            {3: {1: 1.5, 16: 0.9, 64: 0.8}, 1: {16: 1.05, 64: 1.01}, 0: {16: 0.8, 64: 0.9}},
            [[1, 15, 3], [16, END, 1]],
        ),
        ({3: {1: 0.8, 16: 1.1, 64: 0.9}, 0: {1: 0.9, 64: 0.7}}, [[1, 15, 0], [16, END, 3]]),
        ({3: {1: 1.5, 16: 1.1, 64: 0.96}, 0: {64: 0.75}}, None),
    ],
)
def test_the_schedule_proposes_at_each_batch_size_the_drafts_that_were_fastest(ratios, expected):
    from gen_backend_kit.speculation import draft_tokens_at

    schedule = bench.batch_schedule(ratios, 3)
    assert schedule == expected
    section = {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": schedule}
    if schedule is not None:  # a schedule the config takes
        _ngram(speculative={**section, "method": "draft_model", "model": "ngram"}).shutdown()
    for size in ratios[3]:
        fastest = max((j for j in ratios if size in ratios[j]), key=lambda j: ratios[j][size])
        assert draft_tokens_at(section, size) == fastest
        assert draft_tokens_at(section, size + 1) == fastest  # up to the next measured size


def test_the_task_chain_follows_its_table_with_bounded_entropy():
    task = MarkovTask(symbols=32, successors=6, seed=3)
    table = task.transitions(VOCAB)
    ids = slice(task.first_id, task.first_id + task.symbols)
    assert torch.allclose(table.sum(1), torch.ones(VOCAB))
    assert ((table[ids, ids] > 0).sum(1) == task.successors).all()
    assert 1.0 < task.entropy_rate(VOCAB) < math.log(task.successors)
    sequences = task.sample(16, 40, seed=1, vocab=VOCAB)
    assert (table[sequences[:, :-1], sequences[:, 1:]] > 0).all()
    assert torch.equal(sequences, task.sample(16, 40, seed=1, vocab=VOCAB))


def _ngram(**extra):
    from gen_testkit.ngram import NgramGeneration
    from gen_testkit.suite.base import conformance_config

    return NgramGeneration(
        conformance_config(backend="ngram", model_name="ngram", vocab_size=VOCAB, **extra)
    )


def test_the_probe_finds_drafter_refits_where_the_backend_takes_them():
    speculative = {"method": "draft_model", "model": "ngram", "num_speculative_tokens": 3}
    backend = _ngram(speculative=speculative)
    try:
        with Refitter(backend) as refitter:
            assert bench.try_drafter_refit(backend, refitter, backend.state_dict()) is None
    finally:
        backend.shutdown()


def test_the_probe_says_why_where_the_backend_has_no_drafter():
    plain = _ngram()
    try:
        weights = plain.state_dict()
        drafter = {bench.DRAFTER_PREFIX + n: w for n, w in weights.items()}
        with Refitter(plain) as refitter:
            why_not = bench.try_drafter_refit(plain, refitter, {**weights, **drafter})
        assert why_not is not None and "drafter." in why_not
    finally:
        plain.shutdown()


def _rollouts(rows: int = 8, prompt: int = 4, new: int = 12) -> BatchedDataDict:
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (rows, prompt + new))
    return BatchedDataDict(
        output_ids=ids,
        unpadded_sequence_lengths=torch.full((rows,), prompt + new),
        generation_lengths=torch.full((rows,), new),
    )


def _rewarded_mass(model, ids: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    favoured = probs[..., torch.arange(VOCAB) % 4 == 0].sum(-1)
    return float(favoured[mask[:, 1:]].mean())


def test_reinforce_moves_the_target_towards_the_rewarded_tokens():
    from gen_testkit.models import build_tiny_model
    from speculative_models import load_model

    target = load_model(build_tiny_model("tiny-llama").path)
    ids, mask = bench.generated(_rollouts())
    assert mask.sum(1).tolist() == [12] * 8 and not mask[:, :4].any()
    before = _rewarded_mass(target, ids, mask)
    optimizer = torch.optim.Adam(target.parameters(), lr=3e-3)
    for _ in range(5):
        bench.reinforce_step(target, optimizer, ids, mask)
    assert _rewarded_mass(target, ids, mask) > before


def test_online_distillation_brings_the_drafter_towards_the_target():
    from gen_testkit.models import build_tiny_model
    from speculative_models import load_model

    target = load_model(build_tiny_model("tiny-llama").path)
    drafter = load_model(build_tiny_model("tiny-qwen2").path)
    ids, mask = bench.generated(_rollouts())
    teacher = bench.top_k_teacher(target, ids, 16)
    before = bench.top_k_kl(drafter, ids, mask, teacher).item()
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(5):
        kl = bench.top_k_kl(drafter, ids, mask, teacher)
        optimizer.zero_grad()
        kl.backward()
        optimizer.step()
    assert bench.top_k_kl(drafter, ids, mask, teacher).item() < before


def test_the_models_acceptance_is_one_for_the_target_itself_and_less_for_another_drafter():
    from gen_testkit.models import build_tiny_model
    from speculative_models import load_model

    target = load_model(build_tiny_model("tiny-llama").path)
    drafter = load_model(build_tiny_model("tiny-qwen2").path)
    ids, mask = bench.generated(_rollouts())
    assert bench.expected_acceptance(target, target, ids, mask, 3) == pytest.approx(1.0)
    assert 0.0 < bench.expected_acceptance(target, drafter, ids, mask, 3) < 0.99
    # greedy drafts are accepted with the target's probability of the drafter's likeliest token
    with torch.no_grad():
        p = torch.softmax(target(input_ids=ids).logits[:, :-1], -1)
    top = p.max(-1).values[mask[:, 1:]]
    by_hand = float((top + top**2 + top**3).mean() / 3)
    greedy = bench.expected_acceptance(target, target, ids, mask, 3, greedy_drafts=True)
    assert greedy == pytest.approx(by_hand, rel=1e-5)


def test_the_top_k_kl_is_zero_for_the_target_itself_and_positive_for_another_drafter():
    from gen_testkit.models import build_tiny_model
    from speculative_models import load_model

    target = load_model(build_tiny_model("tiny-llama").path)
    drafter = load_model(build_tiny_model("tiny-qwen2").path)
    ids, mask = bench.generated(_rollouts())
    teacher = bench.top_k_teacher(target, ids, 4)
    with torch.no_grad():
        assert bench.top_k_kl(target, ids, mask, teacher).item() == pytest.approx(0.0, abs=1e-5)
        assert bench.top_k_kl(drafter, ids, mask, teacher).item() > 0.01


def _small_recipe():
    import dataclasses

    from speculative_models import DRAFTER, TARGET, Recipe

    small = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1}
    return Recipe(
        task=MarkovTask(symbols=32, successors=4),
        target=dataclasses.replace(TARGET, num_attention_heads=2, num_key_value_heads=1, **small),
        drafter=dataclasses.replace(DRAFTER, num_attention_heads=2, num_key_value_heads=1, **small),
        length=16,
        batch=4,
        target_steps=25,
        drafter_samples=8,
        drafter_steps=50,
    )


def test_prepare_writes_loadable_models_and_reuses_them(tmp_path, monkeypatch, capsys):
    import speculative_models

    monkeypatch.setattr(speculative_models, "ENTROPY_BAND", (0.0, 100.0))
    recipe = _small_recipe()
    built = speculative_models.prepare(recipe, cache=tmp_path)
    assert "target step 25" in capsys.readouterr().out
    for directory in (built.target, built.drafter):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in directory.iterdir()
        }
    assert speculative_models.load_model(built.drafter).config.vocab_size == 512
    assert built.figures["target_steps"] == 25
    assert built.figures["drafter_forward_kl"] >= 0
    again = speculative_models.prepare(recipe, cache=tmp_path)
    assert again == built and "target step" not in capsys.readouterr().out


def test_prepare_refuses_a_target_outside_the_entropy_band(tmp_path, monkeypatch):
    import speculative_models

    monkeypatch.setattr(speculative_models, "ENTROPY_BAND", (0.0, 0.01))
    with pytest.raises(RuntimeError, match="outside"):
        speculative_models.prepare(_small_recipe(), cache=tmp_path)
    assert not list(tmp_path.glob("*speculative-*"))  # nothing half-built is left


def test_the_rl_summary_compares_the_first_and_last_five_steps():
    steps = [
        bench.RlStep(
            step,
            reward=0.0,
            acceptance={"frozen": 0.9 - 0.05 * step},
            expected_acceptance={"frozen": 0.8 - 0.05 * step},
            speed_up={"frozen": 1.0 + step},
            speed_up_batch1={"frozen": 2.0},
        )
        for step in range(10)
    ]
    summary = bench.rl_summary(steps)["frozen"]
    assert summary["acceptance_first"] == pytest.approx(0.8)  # steps 0-4
    assert summary["acceptance_last"] == pytest.approx(0.55)  # steps 5-9
    assert summary["t1_acceptance_last"] == pytest.approx(0.45)
    assert summary["speed_up"] == pytest.approx(5.5)
    assert summary["speed_up_batch1"] == 2.0
