import math

import pytest
import torch
from gen_backend_kit.inputs import normalize_generation_input
from gen_backend_kit.row_sampling import RowSampling, row_seeds_for
from gen_backend_kit.sampling import processed_log_probs, row_generators, select_next_tokens
from gen_interface.seeds import derive_row_seeds
from gen_testkit.strategies import pad_prompts
from hypothesis import assume, given
from hypothesis import strategies as st


def _by_hand(
    logits: list[float], temperature: float, top_k: int | None, top_p: float
) -> tuple[list[float], bool]:
    """The processed distribution computed one token at a time in plain Python (float64).

    Returns the log-probabilities and whether a token sat within 1e-9 of the top-p boundary
    (where a float32 computation may legitimately disagree).
    """
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order)
    if top_k is not None:
        kth = scaled[order[min(top_k, len(order)) - 1]]
        keep = {i for i in keep if scaled[i] >= kth}
    z = sum(math.exp(scaled[i]) for i in keep)
    near_boundary = False
    if top_p < 1:
        cumulative = 0.0
        for i in sorted(keep, key=lambda i: scaled[i])[:-1]:  # ascending; the top one stays
            cumulative += math.exp(scaled[i]) / z
            near_boundary |= abs(cumulative - (1 - top_p)) < 1e-5
            if cumulative <= 1 - top_p:
                keep.discard(i)
    z = sum(math.exp(scaled[i]) for i in keep)
    logprobs = [scaled[i] - math.log(z) if i in keep else -math.inf for i in range(len(scaled))]
    return logprobs, near_boundary


@given(
    # distinct values: with exact ties, which tied token survives a cut is arbitrary
    logits=st.lists(st.integers(-8000, 8000), min_size=2, max_size=24, unique=True).map(
        lambda xs: [x / 1000 for x in xs]
    ),
    temperature=st.floats(0.1, 2.0),
    top_k=st.one_of(st.none(), st.integers(1, 30)),
    top_p=st.floats(0.05, 1.0),
)
def test_processed_distribution_matches_a_hand_computation(logits, temperature, top_k, top_p):
    want, near_boundary = _by_hand(logits, temperature, top_k, top_p)
    assume(not near_boundary)
    got = processed_log_probs(torch.tensor([logits]), temperature, top_k, top_p)[0].tolist()
    assert [g == -math.inf for g in got] == [w == -math.inf for w in want]
    for g, w in zip(got, want):
        assert w == -math.inf or abs(g - w) < 1e-5  # float32 against float64


def test_processed_distribution_without_filters_is_tempered_softmax():
    logits = torch.randn(3, 50)
    got = processed_log_probs(logits, 0.7)
    assert torch.allclose(got, (logits / 0.7).log_softmax(-1), atol=1e-6)
    only_top = processed_log_probs(logits, 1.0, top_k=1)
    assert torch.equal(only_top.argmax(-1), logits.argmax(-1))
    assert bool((only_top.max(-1).values == 0).all())


def test_a_rows_seed_depends_on_its_sample_seed_not_on_the_call_seed():
    batch = pad_prompts([[1], [2]], "left")
    batch["sample_seeds"] = torch.tensor([11, 12])
    seeds = row_seeds_for(normalize_generation_input(batch, pad_token_id=0), 7)
    assert seeds == row_seeds_for(normalize_generation_input(batch, pad_token_id=0), 8)
    assert len(set(seeds)) == 2


@pytest.mark.parametrize("gap_bits", [31, 32, 40, 62])
def test_seeds_differing_only_in_high_bits_give_different_generators(gap_bits):
    """torch's CPU generator keeps 32 bits of its seed: every bit of ours must reach them."""
    low, high = 12345, 12345 + (1 << gap_bits)
    config_pair = [derive_row_seeds(low, 1)[0], derive_row_seeds(high, 1)[0]]
    batch = pad_prompts([[1], [1]], "left")
    batch["sample_seeds"] = torch.tensor([low, high], dtype=torch.int64)
    caller_pair = row_seeds_for(normalize_generation_input(batch, pad_token_id=0), None)
    for pair in (config_pair, caller_pair):
        first, second = (torch.randint(0, 2**31, (4,), generator=g) for g in row_generators(pair))
        assert not torch.equal(first, second)


def _rows(count, *, temperature, top_k=None, top_p=1.0, seed=0):
    return [RowSampling(8, temperature, top_k, top_p, (), (), seed + i) for i in range(count)]


def test_select_next_tokens_greedy_and_sampled():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    tokens, lps, *_ = select_next_tokens(
        logits, _rows(2, temperature=0.0), processed=True, generators=[]
    )
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(lps, logits.log_softmax(-1)[[0, 1], [1, 0]])
    tokens, lps, *_ = select_next_tokens(
        logits,
        _rows(2, temperature=0.5, top_k=1),
        processed=True,
        generators=row_generators([1, 2]),
    )
    assert tokens.tolist() == [1, 0] and lps.tolist() == [0.0, 0.0]
    tokens, raw, *_ = select_next_tokens(
        logits,
        _rows(2, temperature=0.5, top_k=1),
        processed=False,
        generators=row_generators([1, 2]),
    )
    assert torch.allclose(raw, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_each_row_draws_from_its_own_generator():
    logits = torch.zeros(1, 1000)
    alone, _, *_ = select_next_tokens(
        logits, _rows(1, temperature=1.0), processed=False, generators=row_generators([5])
    )
    paired, _, *_ = select_next_tokens(
        logits.expand(2, -1),
        _rows(2, temperature=1.0),
        processed=False,
        generators=row_generators([9, 5]),
    )
    assert int(alone[0]) == int(paired[1])


@given(
    temperatures=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.7]), min_size=1, max_size=5),
    top_ks=st.lists(st.sampled_from([None, 1, 3, 50]), min_size=5, max_size=5),
    top_ps=st.lists(st.sampled_from([1.0, 0.9, 0.3]), min_size=5, max_size=5),
    processed=st.booleans(),
)
def test_a_row_with_its_own_settings_gets_what_it_gets_alone(
    temperatures, top_ks, top_ps, processed
):
    """Mixed greedy and sampled rows, each with its own settings: every row's token and
    logprob equal those of a call with that row alone."""
    logits = torch.randn(len(temperatures), 64, generator=torch.Generator().manual_seed(3)) * 3
    rows = [
        RowSampling(8, t, k, p, (), (), 100 + i)
        for i, (t, k, p) in enumerate(zip(temperatures, top_ks, top_ps))
    ]
    tokens, chosen, *_ = select_next_tokens(
        logits, rows, processed=processed, generators=row_generators([r.seed for r in rows])
    )
    for i, row in enumerate(rows):
        token, lp, *_ = select_next_tokens(
            logits[i : i + 1], [row], processed=processed, generators=row_generators([row.seed])
        )
        assert int(token[0]) == int(tokens[i])
        assert float(lp[0]) == float(chosen[i])
        if row.greedy:
            assert int(tokens[i]) == int(logits[i].argmax())


@pytest.mark.parametrize("temperature", [1e-6, 0.0])
def test_tiny_temperatures_count_as_greedy(temperature):
    from gen_backend_kit.row_sampling import is_greedy

    assert is_greedy(temperature, greedy=False)
    assert not is_greedy(0.5, greedy=False)


@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 2000),
    scale=st.floats(0.0, 12.0),
    masked=st.booleans(),
    seed=st.integers(0, 2**63 - 1),
    steps=st.integers(1, 3),
)
def test_sampled_rows_draw_what_multinomial_draws_from_their_generators(
    rows, vocab, scale, masked, seed, steps
):
    """The batched draw is torch's own ``multinomial``, row by row: the same tokens, and the
    generators left in the same states (so every later step agrees too). A wrong draw (another
    noise, a shared generator, a different reduction) changes tokens and states."""
    torch.manual_seed(seed % 2**32)
    logits = torch.randn(rows, vocab) * scale
    if masked:  # filtered tokens hold -inf, as top-k and top-p leave them
        logits[:, : vocab // 2] = float("-inf")
    settings = [_sampled_row(seed=seed + r) for r in range(rows)]
    ours = row_generators([seed + r for r in range(rows)])
    theirs = row_generators([seed + r for r in range(rows)])
    for _ in range(steps):
        chosen = select_next_tokens(logits, settings, processed=True, generators=ours).tokens
        filtered = processed_log_probs(logits, torch.ones(rows))
        expected = [
            int(torch.multinomial(filtered[r].exp(), 1, generator=theirs[r])) for r in range(rows)
        ]
        assert chosen.tolist() == expected
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.get_state(), b.get_state())


def test_a_row_whose_logits_are_not_finite_is_refused_as_multinomial_refuses_it():
    logits = torch.zeros(2, 8)
    logits[1, 3] = float("nan")
    generators = row_generators([1, 2])
    with pytest.raises(RuntimeError, match=r"inf.*nan"):
        select_next_tokens(
            logits, [_sampled_row(1), _sampled_row(2)], processed=False, generators=generators
        )


@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 500),
    seed=st.integers(0, 2**32 - 1),
    min_p=st.sampled_from([0.0, 0.05]),
)
def test_without_top_k_or_top_p_the_distribution_is_the_sorted_path_s_bit_for_bit(
    rows, vocab, seed, min_p
):
    """No top-k and no top-p skip the vocabulary sort; a top-k of the whole vocabulary goes
    through it and filters nothing, so both must give the same bits."""
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab) * 4
    temperature = torch.rand(rows) + 0.25
    fast = processed_log_probs(logits, temperature, None, 1.0, min_p)
    sorted_path = processed_log_probs(logits, temperature, vocab, 1.0, min_p)
    assert torch.equal(fast, sorted_path)


def _sampled_row(seed: int) -> RowSampling:
    return RowSampling(
        max_new_tokens=1,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        stop_token_ids=(),
        stop_strings=(),
        seed=seed,
        min_p=0.0,
        top_logprobs=0,
    )
