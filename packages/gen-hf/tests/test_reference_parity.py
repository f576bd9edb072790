"""HfGeneration against transformers itself and against a hand computation of the sampler.

- Greedy tokens equal ``model.generate(do_sample=False)`` token for token.
- Raw logprobs equal ``log_softmax`` of one full forward pass over the finished sequences.
- Processed logprobs equal the sampling distribution computed here by hand (temperature, then
  top-k, then top-p over the renormalised top-k distribution), and every sampled token lies
  inside the kept set.

All in float32, with the default (eager) attention; the bound is 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gen_hf.decode
import pytest
import torch
from gen_backend_kit.sampling import TokenChoice, select_next_tokens
from gen_hf import HfConfig, HfGeneration
from gen_interface import BatchedDataDict
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from transformers import PreTrainedModel

ATOL = 1e-5
MAX_NEW_TOKENS = 24
# Within these margins of a top-k or top-p boundary a token may fall on either side, so the
# hand computation cannot say which set was sampled from: float32 rounding of the backend's
# arithmetic on the same logits, and that plus the forward pass's noise on other logits.
SAME_LOGITS_MARGIN = 3e-5
OTHER_LOGITS_MARGIN = 1e-4
SAMPLING_SETTINGS = [(0.8, 40, 0.95), (1.3, None, 0.7), (0.6, 5, 1.0)]


def prompt_sets(vocab_size: int) -> list[list[list[int]]]:
    """Three fixed batches: 1 row, 5 rows and 12 rows of mixed lengths (1 to 30 tokens)."""
    generator = torch.Generator().manual_seed(7)
    sets = []
    for rows, longest in ((1, 9), (5, 16), (12, 30)):
        lengths = torch.randint(1, longest + 1, (rows,), generator=generator).tolist()
        sets.append(
            [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
        )
    return sets


def stop_ids(vocab_size: int) -> list[int]:
    """eos and every 41st id: some rows stop early, others run to the limit."""
    return [2, *range(3, vocab_size, 41)]


@pytest.fixture(scope="module", params=["tiny_qwen2", "tiny_llama"])
def model(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def greedy_backend(
    model: TinyModel, make_config: Callable[..., HfConfig]
) -> Iterator[HfGeneration]:
    backend = HfGeneration(
        make_config(model, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stop_ids(model.vocab_size))
    )
    yield backend
    backend.shutdown()


def generated(
    prompts: list[list[int]], output: BatchedDataDict[Any]
) -> Iterator[tuple[int, int, int, float]]:
    """``(row, position in output_ids, token, reported logprob)`` of every generated token."""
    for i, prompt in enumerate(prompts):
        for position in range(len(prompt), int(output["unpadded_sequence_lengths"][i])):
            yield (
                i,
                position,
                int(output["output_ids"][i, position]),
                float(output["logprobs"][i, position]),
            )


def full_forward_logits(reference: PreTrainedModel, output: BatchedDataDict[Any]) -> torch.Tensor:
    """Logits ``[B, L, V]`` of one forward pass over the finished, right-padded sequences."""
    lengths = output["unpadded_sequence_lengths"]
    width = output["output_ids"].shape[1]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.int64)
    with torch.no_grad():
        return reference(input_ids=output["output_ids"], attention_mask=mask).logits.float()


def hand_processed(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, margin: float
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The processed distribution of one position, computed from scratch in float64.

    Args:
        logits: ``[V]`` raw logits.

    Returns:
        ``(logprobs [V], kept [V] bool, ambiguous)``: ``ambiguous`` when a token lies within
        ``margin`` of the top-k or top-p boundary.
    """
    scaled = logits.double() / temperature
    kept = torch.ones_like(scaled, dtype=torch.bool)
    ambiguous = False
    if top_k is not None and top_k < scaled.numel():
        kth = scaled.topk(top_k).values[-1]
        kept = scaled >= kth  # ties with the k-th value stay
        gap = (scaled - kth).abs()
        ambiguous |= bool(((gap > 0) & (gap < margin)).any())
    if top_p < 1.0:
        probs = scaled.masked_fill(~kept, float("-inf")).softmax(dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        higher_mass = sorted_probs.cumsum(dim=0) - sorted_probs  # mass ranked above each token
        keep_sorted = higher_mass < top_p  # the smallest top set reaching top_p; never empty
        ambiguous |= bool(((higher_mass - top_p).abs() < margin)[sorted_probs > 0].any())
        top_p_kept = torch.zeros_like(kept)
        top_p_kept[order[keep_sorted]] = True
        kept &= top_p_kept
    return scaled.masked_fill(~kept, float("-inf")).log_softmax(dim=-1), kept, ambiguous


@pytest.mark.parametrize("set_index", [0, 1, 2])
def test_greedy_tokens_equal_transformers_generate(
    model: TinyModel,
    greedy_backend: HfGeneration,
    reference_model: Callable[[TinyModel], PreTrainedModel],
    set_index: int,
):
    prompts = prompt_sets(model.vocab_size)[set_index]
    batch = pad_prompts(prompts, "left", pad_token_id=model.pad_token_id)
    ours = greedy_backend.generate(batch, greedy=True)
    stops = stop_ids(model.vocab_size)
    with torch.no_grad():
        generating: Any = reference_model(model)  # transformers types generate() for mixins only
        theirs = generating.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=stops,
            pad_token_id=model.pad_token_id,
        )[:, batch["input_ids"].shape[1] :]
    early_stops = 0
    for i, prompt in enumerate(prompts):
        end = int(ours["unpadded_sequence_lengths"][i])
        tokens = ours["output_ids"][i, len(prompt) : end].tolist()
        reference = theirs[i].tolist()
        assert tokens == reference[: len(tokens)], f"row {i}: {tokens} vs {reference}"
        assert all(t == model.pad_token_id for t in reference[len(tokens) :]), (
            f"row {i}: transformers went on after {len(tokens)} tokens: {reference}"
        )
        assert bool(ours["truncated"][i]) == (tokens[-1] not in stops)
        early_stops += len(tokens) < MAX_NEW_TOKENS
    if set_index == 2:
        assert 0 < early_stops < len(prompts), "the batch should mix early stops and full rows"


@pytest.mark.parametrize("greedy", [True, False])
def test_raw_logprobs_equal_a_full_forward_pass(
    model: TinyModel,
    make_config: Callable[..., HfConfig],
    reference_model: Callable[[TinyModel], PreTrainedModel],
    greedy: bool,
):
    backend = HfGeneration(
        make_config(
            model,
            max_new_tokens=MAX_NEW_TOKENS,
            stop_token_ids=stop_ids(model.vocab_size),
            temperature=0.8,
            top_k=40,
            top_p=0.95,
        )
    )
    worst = 0.0
    for prompts in prompt_sets(model.vocab_size)[1:]:
        for padding in ("left", "mixed"):
            output = backend.generate(pad_prompts(prompts, padding), greedy=greedy)
            raw = full_forward_logits(reference_model(model), output).log_softmax(dim=-1)
            for i, position, token, reported in generated(prompts, output):
                expected = float(raw[i, position - 1, token])
                worst = max(worst, abs(expected - reported))
                if greedy:
                    assert token == int(raw[i, position - 1].argmax())
    backend.shutdown()
    print(
        f"max |raw logprob - full forward| ({model.spec.architecture}, greedy={greedy}): "
        f"{worst:.3g}"
    )
    assert worst <= ATOL, f"raw logprobs differ from a full forward pass by {worst:.3g}"


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SAMPLING_SETTINGS)
def test_processed_logprobs_equal_a_hand_computation(
    model: TinyModel,
    make_config: Callable[..., HfConfig],
    reference_model: Callable[[TinyModel], PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
    temperature: float,
    top_k: int | None,
    top_p: float,
):
    """Two comparisons, to tell the sampler's arithmetic apart from the forward pass's noise:

    - every step's reported logprob against the hand computation from the very logits that
      step sampled from: within ATOL;
    - every output logprob against the hand computation from a full forward pass: within ATOL
      divided by the temperature, which scales the forward pass's float32 noise (the noise
      that ``test_raw_logprobs_equal_a_full_forward_pass`` bounds by ATOL) by 1 / T.
    """
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def recording(logits: torch.Tensor, rows: Any, **kwargs: Any) -> TokenChoice:
        choice = select_next_tokens(logits, rows, **kwargs)
        steps.append((logits.detach().cpu().clone(), choice.tokens.cpu(), choice.logprobs.cpu()))
        return choice

    monkeypatch.setattr(gen_hf.decode, "select_next_tokens", recording)
    backend = HfGeneration(
        make_config(
            model,
            max_new_tokens=16,
            stop_token_ids=stop_ids(model.vocab_size),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            logprobs_mode="processed",
        )
    )
    outputs = [
        (prompts, backend.generate(pad_prompts(prompts, "right"), greedy=False))
        for prompts in prompt_sets(model.vocab_size)[1:]
    ]
    backend.shutdown()

    step_worst, step_checked, skipped = 0.0, 0, 0
    for logits, tokens, chosen in steps:
        for row in range(tokens.numel()):
            logprobs, kept, ambiguous = hand_processed(
                logits[row], temperature, top_k, top_p, SAME_LOGITS_MARGIN
            )
            if ambiguous:
                skipped += 1
                continue
            token = int(tokens[row])
            assert bool(kept[token]), f"a step sampled {token}, outside the kept set"
            step_worst = max(step_worst, abs(float(logprobs[token]) - float(chosen[row])))
            step_checked += 1

    forward_worst, forward_checked = 0.0, 0
    for prompts, output in outputs:
        full = full_forward_logits(reference_model(model), output)
        for i, position, token, reported in generated(prompts, output):
            logprobs, kept, ambiguous = hand_processed(
                full[i, position - 1], temperature, top_k, top_p, OTHER_LOGITS_MARGIN
            )
            if ambiguous:
                continue
            assert bool(kept[token]), f"row {i} sampled {token}, outside the kept set"
            forward_worst = max(forward_worst, abs(float(logprobs[token]) - reported))
            forward_checked += 1

    print(
        f"max |processed logprob - hand| ({model.spec.architecture}, T={temperature}, "
        f"k={top_k}, p={top_p}): {step_worst:.3g} from the sampled logits over {step_checked} "
        f"tokens ({skipped} near a boundary skipped), {forward_worst:.3g} from a full forward "
        f"pass over {forward_checked} tokens"
    )
    assert step_checked > 0 and skipped <= step_checked // 10, (
        f"{skipped} of {step_checked + skipped} tokens lay near a boundary"
    )
    assert forward_checked > 0
    assert step_worst <= ATOL, (
        f"processed logprobs differ from the hand computation by {step_worst:.3g}"
    )
    assert forward_worst <= ATOL / min(temperature, 1.0), (
        f"processed logprobs differ from the hand computation on a full forward pass by "
        f"{forward_worst:.3g}"
    )
