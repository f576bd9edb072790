"""Run two backends through the interface on the same model and inputs, and measure them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from gen_backend_kit.sampling import processed_log_probs
from gen_interface import BatchedDataDict, GenerationInterface, sampling_settings_of

from gen_testkit.parity.metrics import (
    ExactAgreement,
    GreedyAgreement,
    LogprobError,
    SamplingFit,
    TopKAgreement,
    chi_square_fit,
    chosen_matches_top_k,
    exact_agreement,
    greedy_agreement,
    logprob_error,
    score_outputs,
    score_top_k,
    top_k_agreement,
)
from gen_testkit.parity.oracle import LogitsOracle, processed_distribution
from gen_testkit.parity.trace import PairTrace, SamplingTrace, generated_differences
from gen_testkit.parity.workload import ParityBatch, SamplingPlan
from gen_testkit.properties import check_layout, check_prompt_kept
from gen_testkit.routing import RoutingComparison, compare_routing, reference_routing
from gen_testkit.tolerances import Tolerance

__all__ = [
    "SIGNIFICANCE",
    "PairReport",
    "TimedBackend",
    "compare_batch",
    "compare_sampling",
    "processed_error",
    "run_pair",
]

#: Significance level of the sampling goodness-of-fit tests: a backend fails when its samples
#: are this unlikely under the exact distribution.
SIGNIFICANCE = 1e-3

#: The top logprobs every parity generation asks for, and teacher forcing compares.
TOP_K = 5

Progress = Callable[[str], None]


@dataclass
class TimedBackend:
    """A backend under comparison, named, with the time its ``generate`` calls took.

    ``tokens_per_s`` is the backend's own ``tokens_per_second`` metric (tokens returned over the
    time rows ran, counted by the base) where it reports one, else tokens over the timed calls.
    On a parity run's small calls it measures per-call overhead, not throughput: a backend in
    another process pays a round trip per call that one in this process does not, so the
    numbers of two backends are not comparable (``tools/bench`` compares throughput), and
    ``gen-parity`` does not show them.
    """

    name: str
    backend: GenerationInterface
    seconds: float = 0.0
    tokens: int = 0

    def generate(self, data: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
        start = time.perf_counter()
        output = self.backend.generate(data, greedy=greedy)
        self.seconds += time.perf_counter() - start
        self.tokens += int(output["generation_lengths"].sum())
        return output

    @property
    def tokens_per_s(self) -> float:
        counted = self.backend.get_logger_metrics().get("tokens_per_second")
        if counted:
            return float(counted)
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class PairReport:
    """Everything measured for one backend pair; ``failures`` says what broke a tolerance."""

    reference: str
    candidate: str
    dtype: str
    tolerance: Tolerance
    rows: int = 0
    greedy: GreedyAgreement = field(default_factory=GreedyAgreement)
    teacher_forced: LogprobError = field(default_factory=LogprobError)
    top_k: TopKAgreement = field(default_factory=TopKAgreement)
    processed: dict[str, LogprobError] = field(default_factory=dict)
    processed_outside_support: dict[str, int] = field(default_factory=dict)
    sampling: dict[str, list[SamplingFit]] = field(default_factory=dict)
    #: per backend, ``TimedBackend.tokens_per_s``: per-call overhead, not comparable across
    #: backends (kept in the JSON, not shown in the table)
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    #: per backend: its greedy logprobs against the trainer-side exact forward (empty when the
    #: oracle has no transformers model)
    exact: dict[str, ExactAgreement] = field(default_factory=dict)
    #: backends that run with ``batch_invariant: true``: anything short of 1.0 fails them
    batch_invariant: set[str] = field(default_factory=set)
    #: per backend, with ``return_routed_experts``: its rows' routing against transformers'
    #: routers on the same tokens (empty when the backends return none)
    routing: dict[str, RoutingComparison] = field(default_factory=dict)
    #: per backend, in a reduced-precision run with a float32 reference: its greedy rollouts'
    #: logprobs against the float32 model's on the same tokens (what ``lm_head_fp32`` narrows)
    vs_float32: dict[str, LogprobError] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    #: the per-position values behind the numbers above, for pictures (not in ``as_dict``)
    trace: PairTrace = field(default_factory=PairTrace)

    @property
    def ok(self) -> bool:
        return not self.failures

    def judge(self) -> None:
        """Fill ``failures`` from the tolerances and the significance level."""
        t = self.tolerance
        if self.greedy.mismatches:
            self.failures.append(
                f"{self.greedy.mismatches} greedy rows differ beyond near-ties: "
                + "; ".join(self.greedy.details[:3])
            )
        if self.teacher_forced.max_abs > t.logprob_atol:
            self.failures.append(
                f"teacher-forced logprobs differ by {self.teacher_forced.max_abs:.3g} "
                f"> {t.logprob_atol:g}"
            )
        top = self.top_k
        if top.mismatches:
            self.failures.append(
                f"{top.mismatches} teacher-forced top-{TOP_K} lists differ beyond edge ties: "
                + "; ".join(top.details[:3])
            )
        if top.values.max_abs > t.top_k_atol:
            self.failures.append(
                f"teacher-forced top-{TOP_K} logprobs differ by {top.values.max_abs:.3g} "
                f"> {t.top_k_atol:g}"
            )
        if top.chosen_off:
            self.failures.append(
                f"{top.chosen_off} of {top.chosen_checked} generated tokens in their own top-"
                f"{TOP_K} have another logprob there"
            )
        for name, error in self.processed.items():
            if error.max_abs > t.processed_logprob_atol:
                self.failures.append(
                    f"{name}: processed logprobs off the exact distribution by "
                    f"{error.max_abs:.3g} > {t.processed_logprob_atol:g}"
                )
            outside = self.processed_outside_support.get(name, 0)
            # reduced precision: a small share, plus two for small samples
            allowed = t.support_slack * (error.count + outside) + (2 if t.support_slack else 0)
            if outside > allowed:
                self.failures.append(
                    f"{name}: sampled {outside} of {error.count + outside} tokens outside the "
                    f"exact distribution's support (allowed: {t.support_slack:.0%})"
                )
        for name in sorted(self.batch_invariant):
            agreement = self.exact.get(name)
            if agreement is not None and agreement.equal != agreement.total:
                self.failures.append(
                    f"{name}: batch_invariant is on but {agreement.total - agreement.equal} of "
                    f"{agreement.total} generated logprobs differ from the exact forward"
                )
        for name, routing in self.routing.items():
            if routing.mismatches:
                self.failures.append(
                    f"{name}: {len(routing.mismatches)} of {routing.compared} (position, layer) "
                    f"routings differ from transformers' beyond router near-ties, first (row, "
                    f"position, layer): {routing.mismatches[:3]}"
                )
        for name, fits in self.sampling.items():
            for k, fit in enumerate(fits):
                if fit.p_value < SIGNIFICANCE:
                    self.failures.append(
                        f"{name}: samples after prefix {k} do not fit the exact distribution "
                        f"(chi-square p = {fit.p_value:.2g} < {SIGNIFICANCE:g}, "
                        f"{fit.outside_support} outside its support)"
                    )

    def as_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "dtype": self.dtype,
            "rows": self.rows,
            "ok": self.ok,
            "failures": self.failures,
            "tolerance": vars(self.tolerance),
            "significance": SIGNIFICANCE,
            "greedy": {
                "rows": self.greedy.rows,
                "agree": self.greedy.agree,
                "near_ties": self.greedy.near_ties,
                "mismatches": self.greedy.mismatches,
                "details": self.greedy.details,
                "largest_split_gap": max(self.greedy.split_gaps, default=0.0),
            },
            "teacher_forced": self.teacher_forced.summary(),
            "top_k": {
                "k": TOP_K,
                "positions": self.top_k.positions,
                "same": self.top_k.same,
                "edge_ties": self.top_k.boundary_ties,
                "mismatches": self.top_k.mismatches,
                "values": self.top_k.values.summary(),
                "chosen_checked": self.top_k.chosen_checked,
                "chosen_off": self.top_k.chosen_off,
                "details": self.top_k.details,
            },
            "processed": {k: v.summary() for k, v in self.processed.items()},
            "processed_outside_support": self.processed_outside_support,
            "sampling": {k: [f.as_dict() for f in v] for k, v in self.sampling.items()},
            "tokens_per_s": self.tokens_per_s,
            "exact": {k: asdict(v) | {"fraction": v.fraction} for k, v in self.exact.items()},
            "batch_invariant": sorted(self.batch_invariant),
            "routed_experts": {
                name: {
                    "compared": r.compared,
                    "same": r.equal,
                    "near_ties": r.near_ties,
                    "differ": len(r.mismatches),
                }
                for name, r in self.routing.items()
            },
            "vs_float32": {name: e.summary() for name, e in self.vs_float32.items()},
        }


def processed_error(
    output: Mapping[str, Any],
    prompt_lengths: Sequence[int],
    oracle: LogitsOracle,
    config: Mapping[str, Any],
    trace: list[tuple[int, float]] | None = None,
) -> tuple[LogprobError, int]:
    """How far a sampled output's reported (processed) logprobs are from the exact processed
    distribution, and how many of its tokens that distribution excludes; with ``trace``, each
    compared token's ``(generated position, reported - exact)`` is appended to it."""
    temperature, top_k, top_p = sampling_settings_of(config)  # type: ignore[arg-type]
    error, outside = LogprobError(), 0
    for i, start in enumerate(prompt_lengths):
        end = int(output["unpadded_sequence_lengths"][i])
        if end == start:
            continue
        sequence = output["output_ids"][i, :end].tolist()
        logits = oracle.sequence_logits(sequence[:-1])[start - 1 : end - 1]
        exact = processed_log_probs(logits, temperature, top_k, top_p)
        tokens = torch.tensor(sequence[start:end])
        expected = exact.gather(1, tokens[:, None]).squeeze(1)
        reported = output["logprobs"][i, start:end]
        inside = torch.isfinite(expected)
        outside += int((~inside).sum())
        error.add_values(reported[inside], expected[inside])
        if trace is not None:
            diff = reported.double() - expected.double()
            trace.extend((j, float(diff[j])) for j in range(len(diff)) if bool(inside[j]))
    return error, outside


def run_pair(
    reference: TimedBackend,
    candidate: TimedBackend,
    *,
    oracle: LogitsOracle,
    batches: Sequence[ParityBatch],
    plan: SamplingPlan | None,
    tolerance: Tolerance,
    dtype: str,
    progress: Progress = lambda message: None,
    float32: LogitsOracle | None = None,
    advance: Callable[[], None] = lambda: None,
) -> PairReport:
    """Compare ``candidate`` with ``reference``: greedy agreement, teacher-forced logprobs on
    each other's outputs, processed logprobs and sampled first tokens against ``oracle``; with
    ``float32`` (the model in float32), each backend's greedy logprobs against it.

    ``progress`` gets a line as each batch and sampling prefix starts; ``advance`` is called as
    each ends (``len(batches) + len(plan.prefixes)`` times: a progress bar's steps).
    """
    report = PairReport(reference.name, candidate.name, dtype, tolerance)
    report.batch_invariant = {
        b.name for b in (reference, candidate) if b.backend.config.get("batch_invariant")
    }
    for index, batch in enumerate(batches, 1):
        progress(f"batch {index}/{len(batches)}: {len(batch.prompts)} rows")
        compare_batch(report, reference, candidate, batch, oracle, float32)
        advance()
    if plan is not None:
        compare_sampling(report, reference, candidate, plan, oracle, progress, advance)
    report.tokens_per_s = {b.name: b.tokens_per_s for b in (reference, candidate)}
    report.judge()
    return report


def compare_batch(
    report: PairReport,
    reference: TimedBackend,
    candidate: TimedBackend,
    batch: ParityBatch,
    oracle: LogitsOracle,
    float32: LogitsOracle | None = None,
) -> None:
    """Add one batch's greedy, teacher-forced and processed-logprob measurements to ``report``.

    Reported raw logprobs (greedy rows, and sampled rows in raw mode) are compared with the other
    backend's teacher forcing; reported processed logprobs with the exact distribution. Every
    generation asks for ``TOP_K`` top logprobs per token; the greedy rows' teacher-forced top-k
    lists of both backends are compared.
    """
    pair = (reference, candidate)
    for timed in pair:
        report.processed.setdefault(timed.name, LogprobError())
        report.processed_outside_support.setdefault(timed.name, 0)
    data: BatchedDataDict[Any] = BatchedDataDict(batch.data)
    data["top_logprobs"] = torch.full((len(batch.prompts),), TOP_K, dtype=torch.int64)
    greedy = [b.generate(data, greedy=True) for b in pair]
    sampled = [b.generate(data, greedy=False) for b in pair]
    broken = _layout_problems(pair, batch, (*greedy, *sampled))
    if broken:
        report.failures.extend(broken)
        return
    exact = getattr(oracle, "exact_logprobs", None)
    if exact is not None:
        for timed, output in zip(pair, greedy):
            sequences = [
                output["output_ids"][i, : int(end)].tolist()
                for i, end in enumerate(output["unpadded_sequence_lengths"])
            ]
            report.exact.setdefault(timed.name, ExactAgreement()).add(
                exact_agreement(output, batch.prompt_lengths, exact(sequences))
            )
    report.greedy.add(
        greedy_agreement(
            reference.backend,
            greedy[0],
            greedy[1],
            batch.prompt_lengths,
            report.tolerance.near_tie,
        )
    )
    for output in (*greedy, *sampled):
        scores = [score_outputs(b.backend, output, batch.prompt_lengths) for b in pair]
        _add_teacher_forced(report, scores[0], scores[1], output, batch.prompt_lengths)
        report.top_k.add(chosen_matches_top_k(output, batch.prompt_lengths))
    for output in greedy:
        first, second = (
            score_top_k(b.backend, output, batch.prompt_lengths, TOP_K + 1) for b in pair
        )
        report.top_k.add(
            top_k_agreement(
                first, second, output, batch.prompt_lengths, TOP_K, report.tolerance.near_tie
            )
        )
    raw_outputs = list(zip(greedy, reversed(pair)))
    for timed, output in zip(pair, sampled):
        if timed.backend.config.get("logprobs_mode") == "processed":
            error, outside = processed_error(
                output,
                batch.prompt_lengths,
                oracle,
                timed.backend.config,
                report.trace.processed.setdefault(timed.name, []),
            )
            report.processed[timed.name].add(error)
            report.processed_outside_support[timed.name] += outside
        else:
            raw_outputs.append((output, pair[1] if timed is pair[0] else pair[0]))
    for mine, other in raw_outputs:
        # a backend's own reported raw logprobs against the other's teacher forcing
        theirs = score_outputs(other.backend, mine, batch.prompt_lengths)
        _add_teacher_forced(report, mine["logprobs"], theirs, mine, batch.prompt_lengths)
    if float32 is not None:
        for timed, output in zip(pair, greedy):
            report.vs_float32.setdefault(timed.name, LogprobError()).add(
                against_oracle(output, batch.prompt_lengths, float32)
            )
    model = getattr(oracle, "model", None)
    if isinstance(model, torch.nn.Module):
        for timed, output in zip((*pair, *pair), (*greedy, *sampled)):
            if "routed_experts" in output:
                report.routing[timed.name] = report.routing.get(
                    timed.name, RoutingComparison()
                ) + routing_against_model(output, model, report.tolerance.router_near_tie)
    report.rows += len(batch.prompts)


def _add_teacher_forced(
    report: PairReport,
    first: torch.Tensor,
    second: torch.Tensor,
    output: Mapping[str, Any],
    prompt_lengths: Sequence[int],
) -> None:
    """Two ``[B, L]`` raw logprob tensors of ``output``'s rows, into the summary and the trace."""
    report.teacher_forced.add(logprob_error(first, second, output, prompt_lengths))
    report.trace.teacher_forced += generated_differences(first, second, output, prompt_lengths)


def against_oracle(
    output: Mapping[str, Any], prompt_lengths: Sequence[int], oracle: LogitsOracle
) -> LogprobError:
    """A greedy output's reported logprobs against ``oracle``'s raw logprobs of its tokens."""
    error = LogprobError()
    for i, start in enumerate(prompt_lengths):
        end = int(output["unpadded_sequence_lengths"][i])
        if end == start:
            continue
        sequence = output["output_ids"][i, :end].tolist()
        logprobs = oracle.sequence_logits(sequence[:-1])[start - 1 : end - 1].log_softmax(-1)
        expected = logprobs.gather(1, torch.tensor(sequence[start:end])[:, None]).squeeze(1)
        error.add_values(output["logprobs"][i, start:end], expected)
    return error


def routing_against_model(
    output: Mapping[str, Any], model: torch.nn.Module, near_tie: float
) -> RoutingComparison:
    """A generated output's routed experts (every position read: all but the last token)
    against transformers ``model``'s routers on the same tokens."""
    totals = output["unpadded_sequence_lengths"].tolist()
    routed = output["routed_experts"]
    sequences = [output["output_ids"][i, :n].tolist() for i, n in enumerate(totals)]
    references = [reference_routing(model, s, routed.shape[3]) for s in sequences]
    got = [routed[i, : n - 1] for i, n in enumerate(totals)]
    return compare_routing(got, references, near_tie=near_tie)


def compare_sampling(
    report: PairReport,
    reference: TimedBackend,
    candidate: TimedBackend,
    plan: SamplingPlan,
    oracle: LogitsOracle,
    progress: Progress = lambda message: None,
    advance: Callable[[], None] = lambda: None,
) -> None:
    """Test many sampled first tokens of each backend against the exact distribution;
    ``advance`` is called after each prefix."""
    temperature, top_k, top_p = sampling_settings_of(reference.backend.config)
    for k, prefix in enumerate(plan.prefixes, 1):
        progress(
            f"sampling {plan.samples_per_prefix} first tokens after prefix {k}/{len(plan.prefixes)}"
        )
        probs = processed_distribution(
            oracle.next_token_logits([prefix]), temperature, top_k, top_p
        )[0]
        trace = SamplingTrace(expected=probs.tolist())
        for timed in (reference, candidate):
            output = timed.generate(plan.batch(prefix), greedy=False)
            first = output["output_ids"][:, len(prefix)].tolist()
            fit = chi_square_fit(first, probs, support_slack=report.tolerance.support_slack)
            report.sampling.setdefault(timed.name, []).append(fit)
            trace.tokens[timed.name] = first
            trace.p_values[timed.name] = fit.p_value
        report.trace.sampling.append(trace)
        advance()


def _layout_problems(
    pair: Sequence[TimedBackend], batch: ParityBatch, outputs: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Layout rules the metrics rely on (rows in order, prompts kept); one line per break."""
    problems = []
    for index, output in enumerate(outputs):
        name = pair[index % 2].name
        try:
            check_layout(batch.prompts, output)
            check_prompt_kept(batch.prompts, output)
        except AssertionError as exc:
            problems.append(f"{name}: output layout broken ({exc}); rows out of order?")
    return problems
