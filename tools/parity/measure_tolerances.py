"""Measure the floating-point differences behind ``gen_testkit.tolerances``.

    uv run python tools/parity/measure_tolerances.py [--batches 40] [--dtypes float32,bfloat16]

For each dtype, on the tiny Qwen2 model, with every installed model backend (hf, vllm):

- within a backend: each row of a random batch generated again alone (greedy); the largest
  |logprob difference| of equal tokens, and the logprob gaps where tokens split;
- across backends: greedy agreement, teacher-forced and processed logprob errors on random
  batches and sampling settings (``gen_testkit.parity.runner.compare_batch``).

Prints the largest values seen, which the tolerance table must cover.
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from gen_interface import (
    available_backends,
    configure_generation_config,
    create_generation_backend,
)
from gen_testkit.compare import generated_rows
from gen_testkit.models import build_tiny_model
from gen_testkit.parity import HfLogitsOracle, PairReport, TimedBackend
from gen_testkit.parity.runner import TOP_K, compare_batch
from gen_testkit.parity.workload import ParityBatch
from gen_testkit.strategies import pad_prompts
from gen_testkit.tolerances import Tolerance


def random_batch(rng: random.Random, vocab: int) -> ParityBatch:
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(1, 24))]
        for _ in range(rng.randint(2, 8))
    ]
    padding = rng.choice(["left", "right", "mixed", "lengths"])
    return ParityBatch(pad_prompts(prompts, padding), prompts)


def random_sampling(rng: random.Random) -> dict:
    return {
        "max_new_tokens": rng.randint(4, 16),
        "temperature": rng.uniform(0.3, 1.5),
        "top_k": rng.choice([None, rng.randint(1, 80)]),
        "top_p": rng.uniform(0.3, 1.0),
        "seed": rng.randrange(2**31),
    }


def within_backend(backend, batch: ParityBatch) -> tuple[float, list[float]]:
    """Largest |logprob diff| of equal tokens, and the gaps where tokens split (row alone)."""
    together = generated_rows(backend.generate(batch.data, greedy=True))
    worst, gaps = 0.0, []
    for i, prompt in enumerate(batch.prompts):
        (alone,) = generated_rows(backend.generate(pad_prompts([prompt], "right"), greedy=True))
        (tok_a, lp_a), (tok_b, lp_b) = together[i], alone
        for j in range(min(len(tok_a), len(tok_b))):
            if tok_a[j] != tok_b[j]:
                gaps.append(abs(lp_a[j] - lp_b[j]))
                break
            worst = max(worst, abs(lp_a[j] - lp_b[j]))
    return worst, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    model = build_tiny_model("tiny-qwen2")
    names = [n for n in ("hf", "vllm") if n in available_backends()]
    ids = type("Ids", (), {"pad_token_id": 0, "eos_token_id": 2})()
    loose = Tolerance(logprob_atol=1.0, processed_logprob_atol=1.0, near_tie=1.0, support_slack=1.0)
    for dtype in args.dtypes.split(","):
        rng = random.Random(0)
        oracle = HfLogitsOracle(str(model.path), dtype)
        backends = {
            n: create_generation_backend(
                configure_generation_config(
                    {
                        "backend": n,
                        "model_name": str(model.path),
                        "dtype": dtype,
                        "logprobs_mode": "processed",
                        "vllm_cfg": {"cpu_kv_cache_gib": 0.5},
                    }
                    if n == "vllm"
                    else {
                        "backend": n,
                        "model_name": str(model.path),
                        "dtype": dtype,
                        "logprobs_mode": "processed",
                    },
                    ids,
                )
            )
            for n in names
        }
        try:
            within = {n: (0.0, []) for n in names}
            report = PairReport(names[0], names[-1], dtype, loose)
            for _ in range(args.batches):
                batch = random_batch(rng, model.vocab_size)
                sampling = random_sampling(rng)
                for n, backend in backends.items():
                    worst, gaps = within_backend(backend.with_sampling(**sampling), batch)
                    within[n] = (max(within[n][0], worst), within[n][1] + gaps)
                compare_batch(
                    report,
                    TimedBackend(names[0], backends[names[0]].with_sampling(**sampling)),
                    TimedBackend(names[-1], backends[names[-1]].with_sampling(**sampling)),
                    batch,
                    oracle,
                )
            print(f"\n== {dtype}, {args.batches} batches, {report.rows} rows")
            for n, (worst, gaps) in within.items():
                print(
                    f"within {n}: max |d logprob| {worst:.3g}; token splits {len(gaps)}, "
                    f"largest gap {max(gaps, default=0):.3g}"
                )
            print(
                f"across {names[0]} / {names[-1]}: greedy agree {report.greedy.agree}, "
                f"split {report.greedy.rows - report.greedy.agree}"
            )
            print(f"  teacher-forced {report.teacher_forced.summary()}")
            top = report.top_k
            print(
                f"  teacher-forced top-{TOP_K} lists: {top.same} same, {top.boundary_ties} edge "
                f"ties, {top.mismatches} differ of {top.positions}; values {top.values.summary()}"
            )
            for n, error in report.processed.items():
                print(
                    f"  processed {n}: {error.summary()}, outside support "
                    f"{report.processed_outside_support[n]} of "
                    f"{error.count + report.processed_outside_support[n]}"
                )
            gaps = sorted(report.greedy.split_gaps)
            print(f"  greedy split gaps (reference's margin), largest: {gaps[-5:]}")
        finally:
            for backend in backends.values():
                backend.shutdown()


if __name__ == "__main__":
    main()
