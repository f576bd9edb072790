"""Speculative decoding on gen-vllm: speed-up and acceptance, before and during RL.

    uv run python tools/bench/speculative.py [--k 3] [--batches 1,16,64] [--pairs 5] [--new 48]
        [--rl-steps 20] [--rl-batch 16] [--draft-sample-method probabilistic] [--greedy]
        [--drafter-by-restart] [--speed-only] [--quick]
        [--json FILE]

``--quick``: 2 pairs, batch sizes 1 and 16, 3 RL steps. ``--greedy``: every timed run (both
sides) is greedy; the RL rollouts the target learns from stay sampled at temperature 1 (for a
gen-vllm older than its CPU sampling fix, ``gen_vllm.cpu_kernels``, which refused sampled rows
under speculation on CPU; the bench stops and says so when it meets that refusal).

**Models** (``speculative_models.py``, built once and cached): a target Llama (hidden 256, 4
layers) trained on a synthetic Markov task until its mean per-token entropy at temperature 1 is
in [1, 3] nats, and a one-layer drafter (hidden 128, same vocabulary) distilled from it.

**Engines.** gen-vllm (``create_generation_backend``, backend "vllm", one replica each, the CPU
settings of ``step_speed.py``: float32, eager, chunked prefill off, a 1 GiB KV cache) on the
target: ``plain`` without speculation, ``frozen`` with ``speculative: {method: draft_model,
model: <drafter>, num_speculative_tokens: K}``, and, where the backend takes drafter refits
(``"drafter." + <the drafter's Hugging Face name>`` in a refit), ``refit``, the same settings.
Every run samples at temperature 1, exactly ``--new`` tokens a row (no stop token), each row
with a seed of its own; prompts are 16 ids of the task.

**Speed.** For each batch size, ``--pairs`` interleaved pairs (plain then speculative, then the
other way round, so that the machine's drift falls on both sides alike): tokens/s of each, the
ratio (median of the pairs, with their spread) and the acceptance that
``get_logger_metrics()`` reports (``speculative_acceptance_rate`` = accepted / proposed,
``speculative_mean_accepted_length`` = tokens a verifying step emits).

**Which drafts.** vLLM's ``draft_model`` drafts greedily unless told otherwise
(``draft_sample_method="greedy"``: the drafter's likeliest token, taken as certain), so at
temperature 1 a draft is accepted with the target's probability of that token, far below
speculative sampling's ``sum_v min(p(v), q(v))`` on a target of 1-3 nats; ``"probabilistic"``
samples drafts from the drafter and verifies them with its probabilities.
``--draft-sample-method`` picks one for the engines (``speculative.draft_sample_method``;
default ``probabilistic``, gen-vllm's own); the bench prints the acceptance the models give
under both rules (``expected_acceptance``) beside the engine's.

**Break-even acceptance.** A verifying step proposes K tokens and emits ``L = 1 + K * a`` on
average (``a``: the acceptance rate, so that ``L`` is vLLM's mean acceptance length). With
``S`` the measured speed-up (speculative tokens/s over plain tokens/s), one verifying step costs
``c = L / S`` plain decode steps: K drafter forwards, a target forward over K + 1 positions,
rejection sampling, and the rows that wait on the slowest of their batch. Speculation pays
when ``1 + K * a > c``, so the break-even acceptance is ``a* = (c - 1) / K``; above 1 it never
pays at that batch size. (``c`` is taken at the acceptance measured; it barely depends on it.)

**Batch schedule.** Where speculation lost at some batch size (ratio below 1), the bench times,
at those sizes, the same engine proposing fewer drafts, K - 1 down to 0, through
``num_speculative_tokens_per_batch_size`` (``[[1, 1048576, j]]``) against ``plain``, as above. At
0 there are no drafts, but vLLM still runs the drafter's forward over each step's tokens (to
keep its KV cache for when drafting resumes), so that is not free. ``batch_schedule`` then gives
the schedule these figures call for: each size the number of drafts that was fastest there;
an engine built with it is then timed at every batch size. ``--speed-only`` stops here, before
the RL phase.

**RL.** ``--rl-steps`` steps in which the target moves: each step the plain engine samples
``--rl-batch`` rows, the target takes one REINFORCE step on them (reward: the share of a row's
tokens whose id is a multiple of 4, a preference the task's chain does not have, so the
target's distribution drifts from the drafter's), and the new target is refit into every
engine. ``frozen``'s drafter is never refit. ``refit``'s drafter is distilled online, a few
steps of top-k forward KL (``examples/distillation.py``'s, with the rest of the vocabulary as one
more outcome: ``top_k_kl``) towards the new target on the step's rollouts, and refit in the same
refit as the target. Each step reports, per engine, the acceptance on the same ``--rl-batch``
prompts, the acceptance at temperature 1 computed from the models on the step's sampled rollouts
(``expected_acceptance``), the speed-up over ``plain`` at that batch and at batch 1 (one run of
each engine, in the order plain, frozen, refit), and each drafter's top-k KL to the target that
drew the rollouts. Where the backend does not take
drafter refits the bench says so and runs ``frozen`` alone, or, with ``--drafter-by-restart``,
builds the ``refit`` engine anew on the distilled drafter's directory each step (then refits the
target into it; the restart is not timed), which shows the refit drafter's acceptance before
gen-vllm takes drafter refits.

Targets: at least 1.3x tokens/s at batch 1 with the refit drafter; never below 0.95x at any
batch size; the frozen drafter's acceptance falling over the RL steps and the refit one's
holding. Run on an otherwise idle machine: vLLM on a CPU varies by up to 1.7x between runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch
from gen_interface import (
    BatchedDataDict,
    GenerationInputError,
    GenerationInterface,
    create_generation_backend,
)
from gen_interface.weights import Refitter
from speculative_models import Prepared, load_model, prepare, save_model
from workloads import left_padded, sampled_config

PROMPT_TOKENS = 16
DRAFTER_PREFIX = "drafter."
_KV_GIB = 1.0
_NOT_OFFERED = "drafter refits not offered by this backend yet"
#: The last batch size of a schedule's final range (past any engine's max_num_seqs).
SCHEDULE_END = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs per batch size")
    parser.add_argument("--new", type=int, default=48, help="tokens per row")
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--rl-batch", type=int, default=16, help="rows per RL step")
    parser.add_argument("--rl-lr", type=float, default=3e-4, help="the target's REINFORCE lr")
    parser.add_argument("--distill-steps", type=int, default=4, help="drafter steps per RL step")
    parser.add_argument("--distill-lr", type=float, default=3e-4)
    parser.add_argument("--top-k", type=int, default=16, help="top-k of the online distillation")
    parser.add_argument(
        "--draft-sample-method",
        choices=("probabilistic", "greedy"),
        default="probabilistic",
        help="speculative.draft_sample_method of the speculating engines",
    )
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="time greedy rows (both sides); the RL rollouts stay sampled",
    )
    parser.add_argument(
        "--drafter-by-restart",
        action="store_true",
        help="where the backend takes no drafter refits, restart the refit drafter's engine on "
        "the drafter's new weights each step instead of leaving that mode out",
    )
    parser.add_argument(
        "--speed-only", action="store_true", help="the batch sizes and the schedule, no RL phase"
    )
    parser.add_argument("--quick", action="store_true", help="2 pairs, batches 1,16, 3 RL steps")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.batches, args.rl_steps = 2, "1,16", 3
    return args


# ---- break-even ------------------------------------------------------------------------------


def verify_step_cost(speed_up: float, acceptance: float, k: int) -> float:
    """Plain decode steps one verifying step costs: ``(1 + k * acceptance) / speed_up``."""
    return (1 + k * acceptance) / speed_up


def break_even_acceptance(step_cost: float, k: int) -> float:
    """The acceptance rate at which speculation with ``k`` drafts neither gains nor loses:
    ``(step_cost - 1) / k`` (above 1: it never pays; NaN for ``k`` 0: no drafts to accept)."""
    return (step_cost - 1) / k if k else math.nan


def batch_schedule(ratios: dict[int, dict[int, float]], k: int) -> list[list[int]] | None:
    """``num_speculative_tokens_per_batch_size`` from measured speed-ups over plain decoding:
    ``ratios[j][size]`` for an engine proposing ``j`` drafts at every batch size (``ratios[k]``
    at every size measured; fewer drafts where ``k`` lost; ``j`` 0: no drafts, though the drafter
    still runs a forward a step). Each measured size takes the ``j`` that was fastest there, and
    a size between two measured ones takes the smaller one's (vLLM carries a range's k forward);
    None when ``k`` won at every size (no schedule needed)."""
    ranges: list[list[int]] = []
    for size in sorted(ratios[k]):
        tokens = max((j for j in ratios if size in ratios[j]), key=lambda j: ratios[j][size])
        if ranges and ranges[-1][2] == tokens:
            continue
        if ranges:
            ranges[-1][1] = size - 1
        ranges.append([1 if not ranges else size, SCHEDULE_END, tokens])
    return None if ranges == [[1, SCHEDULE_END, k]] else ranges


# ---- engines ---------------------------------------------------------------------------------


class Engine:
    """One gen-vllm backend on a cluster of its own (one replica, one logical CPU)."""

    def __init__(self, name: str, model: str, new: int, speculative: dict[str, Any] | None):
        from gen_vllm import RayVirtualCluster

        self.name = name
        extra: dict[str, Any] = {
            "colocated": {"enabled": False},
            "vllm_cfg": {"cpu_kv_cache_gib": _KV_GIB},
        }
        if speculative is not None:
            extra["speculative"] = speculative
        self.cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
        try:
            self.backend: GenerationInterface = create_generation_backend(
                sampled_config("vllm", model, new, **extra), cluster=self.cluster
            )
        except BaseException:
            self.cluster.shutdown()
            raise
        self.refitter = Refitter(self.backend)

    def run(
        self, batch: BatchedDataDict[Any], greedy: bool = False
    ) -> tuple[float, BatchedDataDict[Any], dict[str, Any]]:
        """(seconds, outputs, logger metrics) of one ``generate`` on a cold prefix cache."""
        self.backend.invalidate_kv_cache()
        self.backend.clear_logger_metrics()
        start = time.perf_counter()
        out = self.backend.generate(batch, greedy=greedy)
        seconds = time.perf_counter() - start
        return seconds, out, self.backend.get_logger_metrics()

    def close(self) -> None:
        self.refitter.close()
        self.backend.shutdown()
        self.cluster.shutdown()


def drafter_named(drafter: Any) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the names a refit carries them by."""
    return {DRAFTER_PREFIX + n: t.detach() for n, t in drafter.state_dict().items()}


def try_drafter_refit(
    backend: GenerationInterface, refitter: Refitter, weights: dict[str, torch.Tensor]
) -> str | None:
    """Refit ``backend`` with ``weights`` (the target's and, under ``drafter.``, the drafter's,
    as it already holds them, so that nothing changes if they are taken); None when the
    backend took them and reports the drafter's version (``speculative_drafter_weight_version``
    equal to the refit's), else why not."""
    try:
        version = refitter.refit(weights)
    except Exception as exc:  # any refusal means "not offered"; the refit was aborted
        return f"{type(exc).__name__}: {exc}"
    reported = backend.get_logger_metrics().get("speculative_drafter_weight_version")
    if reported != version:
        return (
            f"the refit committed version {version} but speculative_drafter_weight_version is "
            f"{reported!r}"
        )
    return None


# ---- figures ---------------------------------------------------------------------------------


@dataclass
class SpeedFigure:
    """One batch size: every pair's runs and the speculative runs' acceptance."""

    batch: int
    tokens: int
    plain_seconds: list[float] = field(default_factory=list)
    spec_seconds: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    mean_accepted_length: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [p / s for p, s in zip(self.plain_seconds, self.spec_seconds)]

    def summary(self, k: int) -> dict[str, float]:
        ratio = statistics.median(self.ratios())
        acceptance = statistics.median(self.acceptance) if self.acceptance else 0.0
        cost = verify_step_cost(ratio, acceptance, k)
        return {
            "plain_tokens_s": self.tokens / statistics.median(self.plain_seconds),
            "spec_tokens_s": self.tokens / statistics.median(self.spec_seconds),
            "ratio": ratio,
            "ratio_min": min(self.ratios()),
            "ratio_max": max(self.ratios()),
            "acceptance": acceptance,
            "verify_step_cost": cost,
            "break_even_acceptance": break_even_acceptance(cost, k),
        }


@dataclass
class RlStep:
    """One RL step: the target's reward before its update, and per speculative engine its
    acceptance, speed-ups over plain and its drafter's top-k KL to the target it served."""

    step: int
    reward: float
    acceptance: dict[str, float] = field(default_factory=dict)
    speed_up: dict[str, float] = field(default_factory=dict)
    speed_up_batch1: dict[str, float] = field(default_factory=dict)
    drafter_kl: dict[str, float] = field(default_factory=dict)
    expected_acceptance: dict[str, float] = field(default_factory=dict)
    expected_acceptance_greedy_drafts: dict[str, float] = field(default_factory=dict)


# ---- the task's prompts and the RL update ----------------------------------------------------


def prompts(prepared: Prepared, rows: int, seed: int) -> BatchedDataDict[Any]:
    task = prepared.recipe.task
    ids = task.sample(rows, PROMPT_TOKENS, seed=seed, vocab=prepared.recipe.target.vocab_size)
    return left_padded(ids.tolist())


def generated(out: BatchedDataDict[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[B, L]`` ids of prompt and generation, ``[B, L]`` mask of the generated tokens)."""
    ids = out["output_ids"]
    ends = out["unpadded_sequence_lengths"]
    starts = ends - out["generation_lengths"]
    positions = torch.arange(ids.shape[1])
    return ids, (positions >= starts[:, None]) & (positions < ends[:, None])


def rewards(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row: the share of its generated tokens whose id is a multiple of 4."""
    return ((ids % 4 == 0) & mask).sum(1) / mask.sum(1).clamp(min=1)


def reinforce_step(target: Any, optimizer: Any, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """One REINFORCE step (batch-mean baseline, normalised advantages); the mean reward."""
    reward = rewards(ids, mask).float()
    advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
    logprobs = torch.log_softmax(target(input_ids=ids).logits[:, :-1].float(), -1)
    chosen = logprobs.gather(2, ids[:, 1:, None])[..., 0]  # position t + 1's token
    scored = mask[:, 1:].float()
    loss = -((chosen * scored).sum(1) * advantage).sum() / scored.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(reward.mean())


def top_k_teacher(target: Any, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's ``k`` likeliest next tokens and their logprobs at every position."""
    with torch.no_grad():
        logprobs = torch.log_softmax(target(input_ids=ids).logits[:, :-1].float(), -1)
    top = logprobs.topk(k, -1)
    return top.indices, top.values


def top_k_kl(
    drafter: Any, ids: torch.Tensor, mask: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Mean over generated positions of the forward KL between the teacher and the drafter over
    the teacher's top k tokens and, as one more outcome, all the others (its ``1 - sum``).

    A true KL of the two distributions so coarsened (never negative, zero where they agree).
    ``examples/distillation.py``'s top-k sum alone leaves the rest out, which lets the student
    pile mass onto the k tokens: here that cost the drafter's acceptance (0.92 to 0.75 in a few
    steps) where this form held it.
    """
    top_ids, top_logprobs = teacher
    student = torch.log_softmax(drafter(input_ids=ids).logits[:, :-1].float(), -1)
    chosen = student.gather(2, top_ids)
    p = top_logprobs.exp()
    per_position = (p * (top_logprobs - chosen)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(1e-12)
    q_rest = (1 - chosen.exp().sum(-1)).clamp_min(1e-12)
    per_position = per_position + p_rest * (p_rest.log() - q_rest.log())
    return per_position[mask[:, 1:]].mean()


def expected_acceptance(
    target: Any,
    drafter: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    k: int,
    greedy_drafts: bool = False,
) -> float:
    """The acceptance rate (accepted / proposed) that ``k`` drafts would get at temperature 1,
    computed from the two models on the target's own samples ``ids``: at every generated
    position the chance that a draft token is accepted is ``a = sum_v min(p(v), q(v))`` for
    drafts sampled from the drafter (speculative sampling's rule; vLLM's
    ``draft_sample_method="probabilistic"``), or ``a = p(argmax q)`` with ``greedy_drafts``
    (the drafter's likeliest token, taken as certain: vLLM's default, ``"greedy"``); a step
    accepts ``a + a^2 + ... + a^k`` of its ``k`` drafts on average if every draft position had
    that ``a``."""
    with torch.no_grad():
        p = torch.softmax(target(input_ids=ids).logits[:, :-1].float(), -1)
        q = torch.softmax(drafter(input_ids=ids).logits[:, :-1].float(), -1)
    if greedy_drafts:
        overlap = p.gather(2, q.argmax(-1, keepdim=True))[..., 0][mask[:, 1:]]
    else:
        overlap = torch.minimum(p, q).sum(-1)[mask[:, 1:]]
    runs = torch.stack([overlap**j for j in range(1, k + 1)]).sum(0)
    return float(runs.mean() / k)


# ---- the bench -------------------------------------------------------------------------------


_SPEED_HEADER = (
    "| batch | plain tok/s | speculative tok/s | ratio (spread) | acceptance "
    "| verify step / plain step | break-even acceptance |\n|---|---|---|---|---|---|---|"
)


def measure_speed(
    plain: Engine,
    spec: Engine,
    prepared: Prepared,
    args: argparse.Namespace,
    sizes: list[int] | None = None,
    k: int | None = None,
) -> list[SpeedFigure]:
    """``--pairs`` interleaved pairs of ``plain`` and ``spec`` at each batch size (``sizes``,
    default ``--batches``), a table row each; ``k``: the drafts ``spec`` proposes (``--k``)."""
    print(_SPEED_HEADER, flush=True)
    figures = []
    k = args.k if k is None else k
    for size in sizes or [int(b) for b in args.batches.split(",")]:
        batch = prompts(prepared, size, seed=100 + size)
        figure = SpeedFigure(size, tokens=size * args.new)
        plain.run(batch, args.greedy)  # warm-up, each side
        spec.run(batch, args.greedy)
        for pair in range(args.pairs):
            order = (plain, spec) if pair % 2 == 0 else (spec, plain)
            for engine in order:
                seconds, _, metrics = engine.run(batch, args.greedy)
                if engine is plain:
                    figure.plain_seconds.append(seconds)
                else:
                    figure.spec_seconds.append(seconds)
                    figure.acceptance.append(float(metrics["speculative_acceptance_rate"]))
                    figure.mean_accepted_length.append(
                        float(metrics["speculative_mean_accepted_length"])
                    )
        s = figure.summary(k)
        print(
            f"| {size} | {s['plain_tokens_s']:.0f} | {s['spec_tokens_s']:.0f} | {s['ratio']:.3f} "
            f"({s['ratio_min']:.2f}-{s['ratio_max']:.2f}) | {s['acceptance']:.3f} "
            f"| {s['verify_step_cost']:.2f} | {s['break_even_acceptance']:.3f} |",
            flush=True,
        )
        figures.append(figure)
    return figures


def rl_phase(
    engines: dict[str, Engine],
    prepared: Prepared,
    target: Any,
    args: argparse.Namespace,
    restart: Callable[[Path], Engine] | None = None,
) -> list[RlStep]:
    """``args.rl_steps`` steps; ``engines`` holds ``plain``, ``frozen`` and maybe ``refit``.

    ``restart``: where the backend takes no drafter refits, builds the ``refit`` engine anew on
    a drafter directory (written under ``args.scratch``); the new engine then gets the target's
    weights by a refit. None: the drafter goes in the target's refit.
    """
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(target.parameters(), lr=args.rl_lr)
    drafters = {name: load_model(prepared.drafter) for name in engines if name != "plain"}
    distiller = (
        torch.optim.Adam(drafters["refit"].parameters(), lr=args.distill_lr)
        if "refit" in drafters
        else None
    )
    steps = []
    for step in range(args.rl_steps):
        batch = prompts(prepared, args.rl_batch, seed=10_000 + step)
        single = prompts(prepared, 1, seed=20_000 + step)
        seconds: dict[str, float] = {}
        single_seconds: dict[str, float] = {}
        record = RlStep(step, reward=0.0)
        rollouts = None
        for name, engine in engines.items():
            seconds[name], out, metrics = engine.run(batch, args.greedy)
            single_seconds[name] = engine.run(single, args.greedy)[0]
            if name == "plain":  # the target's samples at temperature 1, to learn from
                rollouts = engine.run(batch)[1] if args.greedy else out
            else:
                record.acceptance[name] = float(metrics["speculative_acceptance_rate"])
        for name in drafters:
            record.speed_up[name] = seconds["plain"] / seconds[name]
            record.speed_up_batch1[name] = single_seconds["plain"] / single_seconds[name]
        assert rollouts is not None
        ids, mask = generated(rollouts)
        teacher = top_k_teacher(target, ids, args.top_k)  # the target these rollouts came from
        with torch.no_grad():
            for name, drafter in drafters.items():
                record.drafter_kl[name] = float(top_k_kl(drafter, ids, mask, teacher))
                record.expected_acceptance[name] = expected_acceptance(
                    target, drafter, ids, mask, args.k
                )
                record.expected_acceptance_greedy_drafts[name] = expected_acceptance(
                    target, drafter, ids, mask, args.k, greedy_drafts=True
                )
        record.reward = reinforce_step(target, optimizer, ids, mask)
        if distiller is not None:
            teacher = top_k_teacher(target, ids, args.top_k)  # the target after its step
            for _ in range(args.distill_steps):
                kl = top_k_kl(drafters["refit"], ids, mask, teacher)
                distiller.zero_grad()
                kl.backward()
                distiller.step()
        weights = {n: t.detach() for n, t in target.state_dict().items()}
        if restart is not None:
            directory = Path(args.scratch) / f"drafter-{step}"
            save_model(drafters["refit"], prepared.drafter, directory)
            engines.pop("refit").close()
            engines["refit"] = restart(directory)
            engines["refit"].refitter.refit(weights)
            warm_up = prompts(prepared, args.rl_batch, seed=40_000 + step)
            engines["refit"].run(warm_up, args.greedy)  # a new engine's first call is slower
        for name, engine in engines.items():
            if name == "refit" and restart is not None:
                continue  # refit when it was built
            if name == "refit":
                engine.refitter.refit({**weights, **drafter_named(drafters["refit"])})
            else:
                engine.refitter.refit(weights)
        print(_rl_row(record), flush=True)
        steps.append(record)
    return steps


def rl_summary(steps: list[RlStep]) -> dict[str, dict[str, float]]:
    """Per drafter: its acceptance (the engine's, and at temperature 1 from the models) over the
    first and the last five steps (medians), and the median speed-ups over all the steps."""
    summary = {}
    for name in steps[0].acceptance if steps else {}:
        first, last = steps[:5], steps[-5:]
        summary[name] = {
            "acceptance_first": statistics.median(s.acceptance[name] for s in first),
            "acceptance_last": statistics.median(s.acceptance[name] for s in last),
            "t1_acceptance_first": statistics.median(s.expected_acceptance[name] for s in first),
            "t1_acceptance_last": statistics.median(s.expected_acceptance[name] for s in last),
            "speed_up": statistics.median(s.speed_up[name] for s in steps),
            "speed_up_batch1": statistics.median(s.speed_up_batch1[name] for s in steps),
        }
    return summary


def _rl_row(r: RlStep) -> str:
    def pick(values: dict[str, float], name: str, fmt: str) -> str:
        return format(values[name], fmt) if name in values else "-"

    cells = [str(r.step), f"{r.reward:.3f}"]
    for name in ("frozen", "refit"):
        cells += [
            pick(r.acceptance, name, ".3f"),
            pick(r.expected_acceptance, name, ".3f"),
            pick(r.expected_acceptance_greedy_drafts, name, ".3f"),
            pick(r.speed_up, name, ".2f"),
            pick(r.speed_up_batch1, name, ".2f"),
            pick(r.drafter_kl, name, ".3f"),
        ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prepared = prepare()
    print(f"models: {json.dumps(prepared.figures)}", flush=True)
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    speculative = {
        "method": "draft_model",
        "model": str(prepared.drafter),
        "num_speculative_tokens": args.k,
        "draft_sample_method": args.draft_sample_method,
    }
    engines: dict[str, Engine] = {}
    result: dict[str, Any] = {"settings": dict(vars(args)), "models": prepared.figures}
    try:
        engines["plain"] = Engine("plain", str(prepared.target), args.new, None)
        engines["frozen"] = Engine("frozen", str(prepared.target), args.new, speculative)
        print(
            f"\nbatch sizes, K={args.k}, {args.new} tokens a row, "
            f"{'greedy' if args.greedy else 'temperature 1'}",
            flush=True,
        )
        try:
            speed = measure_speed(engines["plain"], engines["frozen"], prepared, args)
        except GenerationInputError as exc:
            if args.greedy:
                raise
            raise SystemExit(
                f"the speculative engine refused sampled rows ({exc}); on vLLM's CPU build rerun "
                "with --greedy, which times greedy rows on both sides"
            ) from exc
        result["speed"] = [{**asdict(f), **f.summary(args.k)} for f in speed]
        lost = [r["batch"] for r in result["speed"] if r["ratio"] < 1.0]
        ratios = {args.k: {r["batch"]: r["ratio"] for r in result["speed"]}}
        for fewer in range(args.k - 1, -1, -1) if lost else ():
            schedule = [[1, SCHEDULE_END, fewer]]
            print(
                f"\nspeculation lost at batch size(s) {lost}: there, the same engine with "
                f"{fewer} draft(s) a step (num_speculative_tokens_per_batch_size {schedule}"
                f"{'; the drafter still runs its forward' if fewer == 0 else ''})",
                flush=True,
            )
            name = f"k{fewer}"
            settings = {**speculative, "num_speculative_tokens_per_batch_size": schedule}
            engines[name] = Engine(name, str(prepared.target), args.new, settings)
            figures = measure_speed(engines["plain"], engines[name], prepared, args, lost, fewer)
            engines.pop(name).close()
            rows = [{**asdict(f), **f.summary(fewer)} for f in figures]
            result[f"speed_{fewer}_drafts"] = rows
            ratios[fewer] = {r["batch"]: r["ratio"] for r in rows}
        if lost:
            result["schedule"] = batch_schedule(ratios, args.k)
            best = {b: max(r[b] for r in ratios.values() if b in r) for b in ratios[args.k]}
            print(
                f"the batch schedule these figures give: {result['schedule']} (None: always "
                f"{args.k} drafts); its ratio per batch size: "
                + ", ".join(f"{b} {best[b]:.3f}" for b in sorted(best)),
                flush=True,
            )
        if result.get("schedule"):
            print("\nthat schedule, timed at every batch size", flush=True)
            settings = {**speculative, "num_speculative_tokens_per_batch_size": result["schedule"]}
            engines["scheduled"] = Engine("scheduled", str(prepared.target), args.new, settings)
            figures = measure_speed(engines["plain"], engines["scheduled"], prepared, args)
            engines.pop("scheduled").close()
            result["scheduled_speed"] = [{**asdict(f), **f.summary(args.k)} for f in figures]
        if not args.speed_only:
            rl_part(engines, prepared, args, speculative, result)
    finally:
        for engine in engines.values():
            engine.close()
        if started_ray:
            ray.shutdown()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return result


def rl_part(
    engines: dict[str, Engine],
    prepared: Prepared,
    args: argparse.Namespace,
    speculative: dict[str, Any],
    result: dict[str, Any],
) -> None:
    """The temperature-1 acceptance the models predict, then the RL phase (``rl_phase``) with
    the frozen drafter and, where the backend takes drafter refits, the refit one; figures into
    ``result``, engines into ``engines`` (the caller closes them)."""
    target = load_model(prepared.target)
    sampled = engines["plain"].run(prompts(prepared, 64, seed=30_000))[1]
    drafter = load_model(prepared.drafter)
    t1 = expected_acceptance(target, drafter, *generated(sampled), args.k)
    t1_greedy = expected_acceptance(
        target, drafter, *generated(sampled), args.k, greedy_drafts=True
    )
    result["expected_t1_acceptance"] = t1
    result["expected_t1_acceptance_greedy_drafts"] = t1_greedy
    print(
        f"\nacceptance at temperature 1, from the models on the target's samples: {t1:.3f} "
        f"with sampled drafts, {t1_greedy:.3f} with greedy drafts (vLLM's default)"
    )
    for row in result["speed"]:
        row["predicted_t1_ratio"] = (1 + args.k * t1) / row["verify_step_cost"]
        row["predicted_t1_ratio_greedy_drafts"] = (1 + args.k * t1_greedy) / row["verify_step_cost"]
        print(
            f"batch {row['batch']}: predicted temperature-1 ratio "
            f"{row['predicted_t1_ratio']:.3f} with sampled drafts, "
            f"{row['predicted_t1_ratio_greedy_drafts']:.3f} with greedy drafts (these "
            "acceptances, the verifying step's cost measured above)"
        )
    engines["refit"] = Engine("refit", str(prepared.target), args.new, speculative)
    refit_engine = engines["refit"]
    why_not = try_drafter_refit(
        refit_engine.backend,
        refit_engine.refitter,
        {**target.state_dict(), **drafter_named(load_model(prepared.drafter))},
    )
    result["drafter_refits"] = why_not or "offered"
    restart = None
    if why_not is not None and args.drafter_by_restart:
        print(
            f"\n{_NOT_OFFERED} ({why_not}): the refit drafter reaches its engine by a "
            "restart each step (--drafter-by-restart; the restart is not timed)"
        )
        result["drafter_refits"] = f"by restart: {why_not}"

        def restart(drafter: Path) -> Engine:
            spec = {**speculative, "model": str(drafter)}
            return Engine("refit", str(prepared.target), args.new, spec)

    elif why_not is not None:
        print(f"\n{_NOT_OFFERED} ({why_not}): the RL phase runs the frozen drafter only")
        engines.pop("refit").close()
    if "refit" in engines:  # a new engine's first call is slower
        engines["refit"].run(prompts(prepared, args.rl_batch, seed=39_999), args.greedy)
    print(
        f"\nRL steps: rewards and per drafter: acceptance, speed-up at batch "
        f"{args.rl_batch} and at batch 1, top-{args.top_k} KL to the target\n"
        "| step | reward | frozen acc. | frozen T=1 acc. (models) | frozen, greedy drafts "
        "| frozen x | frozen x b1 | frozen KL | refit acc. | refit T=1 acc. (models) "
        "| refit, greedy drafts | refit x | refit x b1 | refit KL |\n" + "|---" * 14 + "|",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="speculative-drafters-") as scratch:
        args.scratch = scratch
        steps = rl_phase(engines, prepared, target, args, restart)
    result["rl"] = [asdict(s) for s in steps]
    result["rl_summary"] = rl_summary(steps)
    for name, figures in result["rl_summary"].items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
