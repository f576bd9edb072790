"""Mixed-length throughput of ``generate`` against ``generate_async``, and serving while refitting.

    uv run python tools/bench/async_throughput.py [--model bench-50m] [--replicas 1,2] \
        [--rows 32] [--new 8,256] [--buckets 4] [--seconds 12] [--refit-every 3]

On a random float32 testkit model in gen-vllm (CPU, one and two replicas), sampled generation
(temperature 1.0, fixed seed, no stop tokens, so every row runs to its own length).

Workload: ``--rows`` prompts of random token ids (ints in ``[3, vocab)``, 8-32 tokens, left
padded); each row draws its ``max_new_tokens`` from ``--buckets`` lengths spread evenly over
``--new`` (so one call per distinct length: ``max_new_tokens`` is a per-call setting, set on a
``backend.with_sampling(max_new_tokens=n)`` view). The calls, one per bucket, are issued in the
order of each bucket's first row (row 0's bucket first), as a caller that does not sort would:

- ``generate, serial``: one ``generate`` call after another, in this thread; a row counts as
  finished when its call returns.
- ``generate, threads``: the same calls, each ``generate`` in a thread of its own, all at once.
- ``generate_async``: the same calls as ``generate_async`` iterators consumed concurrently by one
  event loop; a row counts as finished when it is yielded.

Reports total generated tokens (sum of ``generation_lengths``) per wall second and the time to
the first finished row.

Refit loop: for ``--seconds``, ``--streams`` concurrent callers each issue ``generate_async``
calls of ``--stream-rows`` rows (a bucket's length per call, cycling) one after another; rows
yielded before the deadline count as served (the calls still open then are closed, which aborts
their rows). Once without refits, then again while a thread calls
``Refitter(backend).refit(weights + small noise, in_flight="keep")`` every ``--refit-every``
seconds. Reports rows served per second, the refits done (and their mean time), and how many
served rows saw two or more weight versions over their generated tokens (``weight_versions``
at positions ``p .. p+g-1``).

Prints markdown tables at the end. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch
from gen_interface import BatchedDataDict, configure_generation_config
from gen_interface.weights import Refitter
from gen_testkit.models import TinyModel, build_tiny_model
from gen_testkit.strategies import pad_prompts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-50m", help="testkit preset")
    parser.add_argument("--replicas", default="1,2", help="replica counts to run, comma-separated")
    parser.add_argument("--rows", type=int, default=32, help="rows in the mixed-length workload")
    parser.add_argument("--new", default="8,256", help="smallest,largest max_new_tokens")
    parser.add_argument("--buckets", type=int, default=4, help="distinct max_new_tokens values")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each refit loop")
    parser.add_argument("--refit-every", type=float, default=3.0, help="seconds between refits")
    parser.add_argument("--streams", type=int, default=2, help="concurrent callers in the loop")
    parser.add_argument("--stream-rows", type=int, default=8, help="rows per call in the loop")
    parser.add_argument("--kv-gib", type=float, default=0.5, help="vllm_cfg.cpu_kv_cache_gib")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# ---- workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    """Rows grouped into one call per ``max_new_tokens`` bucket, in the order calls are issued."""

    calls: list[tuple[int, BatchedDataDict[Any]]]  # (max_new_tokens, padded prompts)

    @property
    def rows(self) -> int:
        return sum(int(data["input_ids"].shape[0]) for _, data in self.calls)


def bucket_lengths(args: argparse.Namespace) -> list[int]:
    low, high = (int(x) for x in args.new.split(","))
    if args.buckets == 1:
        return [high]
    step = (high - low) / (args.buckets - 1)
    return [round(low + i * step) for i in range(args.buckets)]


def random_prompts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(count)]


def build_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    lengths = bucket_lengths(args)
    prompts = random_prompts(rng, args.rows, vocab)
    drawn = [rng.choice(lengths) for _ in prompts]
    order = list(dict.fromkeys(drawn))  # buckets in the order of their first row
    calls = []
    for n in order:
        rows = [p for p, d in zip(prompts, drawn) if d == n]
        calls.append((n, pad_prompts(rows, "left")))
    return Workload(calls)


# ---- backend -------------------------------------------------------------------------------


def build_backend(model: TinyModel, replicas: int, args: argparse.Namespace) -> Any:
    from gen_vllm import VllmGeneration

    tokenizer = type("Ids", (), {"pad_token_id": 0, "eos_token_id": 2})()
    config: dict[str, Any] = {
        "backend": "vllm",
        "model_name": str(model.path),
        "max_new_tokens": 8,
        "dtype": "float32",
        "stop_token_ids": [],
        "temperature": 1.0,
        "seed": args.seed,
        "vllm_cfg": {"cpu_kv_cache_gib": args.kv_gib},
    }
    return VllmGeneration.create(
        configure_generation_config(config, tokenizer), replicas=replicas, use_gpus=False
    )


def generated_versions(out: BatchedDataDict[Any], row: int) -> set[int]:
    """The distinct weight versions over a row's generated positions ``p .. p+g-1``."""
    g = int(out["generation_lengths"][row])
    p = int(out["unpadded_sequence_lengths"][row]) - g
    return set(out["weight_versions"][row, p : p + g].tolist())


# ---- mixed-length workload -----------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_row_s: float = float("inf")


def run_serial(views: dict[int, Any], work: Workload) -> ModeResult:
    result = ModeResult("generate, serial")
    start = time.perf_counter()
    for n, data in work.calls:
        out = views[n].generate(data)
        result.first_row_s = min(result.first_row_s, time.perf_counter() - start)
        result.rows += int(out["generation_lengths"].shape[0])
        result.tokens += int(out["generation_lengths"].sum())
    result.seconds = time.perf_counter() - start
    return result


def run_threads(views: dict[int, Any], work: Workload) -> ModeResult:
    result = ModeResult("generate, threads")
    lock = threading.Lock()
    start = time.perf_counter()

    def one(n: int, data: BatchedDataDict[Any]) -> None:
        out = views[n].generate(data)
        with lock:
            result.first_row_s = min(result.first_row_s, time.perf_counter() - start)
            result.rows += int(out["generation_lengths"].shape[0])
            result.tokens += int(out["generation_lengths"].sum())

    with ThreadPoolExecutor(len(work.calls)) as pool:
        for future in [pool.submit(one, n, data) for n, data in work.calls]:
            future.result()
    result.seconds = time.perf_counter() - start
    return result


def run_async(views: dict[int, Any], work: Workload) -> ModeResult:
    result = ModeResult("generate_async")

    async def consume(n: int, data: BatchedDataDict[Any], start: float) -> None:
        async for _, out in views[n].generate_async(data):
            result.first_row_s = min(result.first_row_s, time.perf_counter() - start)
            result.rows += 1
            result.tokens += int(out["generation_lengths"].sum())

    async def everything() -> None:
        start = time.perf_counter()
        await asyncio.gather(*(consume(n, data, start) for n, data in work.calls))
        result.seconds = time.perf_counter() - start

    asyncio.run(everything())
    return result


# ---- serving while refitting ---------------------------------------------------------------


@dataclass
class LoopResult:
    refitting: bool
    seconds: float = 0.0
    rows: int = 0
    mixed_rows: int = 0  # rows whose generated tokens came from two or more weight versions
    refit_times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def serve_loop(
    views: dict[int, Any],
    args: argparse.Namespace,
    vocab: int,
    refit: Callable[[], None] | None,
) -> LoopResult:
    result = LoopResult(refitting=refit is not None)
    lengths = list(views)
    stop_refits = threading.Event()

    def refitter() -> None:
        while not stop_refits.wait(args.refit_every):
            assert refit is not None
            start = time.perf_counter()
            try:
                refit()
            except Exception as error:  # report it, keep serving
                result.errors.append(f"refit: {type(error).__name__}: {error}")
                return
            result.refit_times.append(time.perf_counter() - start)

    async def caller(index: int, deadline: float) -> None:
        rng = random.Random(args.seed * 1000 + index)
        call = index
        while time.perf_counter() < deadline:
            n = lengths[call % len(lengths)]
            call += 1
            data = pad_prompts(random_prompts(rng, args.stream_rows, vocab), "left")
            stream: AsyncGenerator[tuple[int, BatchedDataDict[Any]], None] = views[
                n
            ].generate_async(data)
            try:
                while True:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        return
                    try:
                        _, out = await asyncio.wait_for(anext(stream), remaining)
                    except (StopAsyncIteration, TimeoutError):
                        break
                    result.rows += 1
                    result.mixed_rows += len(generated_versions(out, 0)) > 1
            finally:
                await stream.aclose()

    async def everything() -> None:
        start = time.perf_counter()
        deadline = start + args.seconds
        await asyncio.gather(*(caller(i, deadline) for i in range(args.streams)))
        result.seconds = time.perf_counter() - start

    thread = threading.Thread(target=refitter, daemon=True) if refit is not None else None
    if thread is not None:
        thread.start()
    try:
        asyncio.run(everything())
    finally:
        stop_refits.set()
        if thread is not None:
            thread.join()
    return result


# ---- main ----------------------------------------------------------------------------------


def measure(
    replicas: int, model: TinyModel, weights: dict[str, torch.Tensor], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    start = time.perf_counter()
    backend = build_backend(model, replicas, args)
    print(f"x{replicas}: engines up in {time.perf_counter() - start:.1f} s", flush=True)
    modes: list[dict[str, Any]] = []
    loops: list[dict[str, Any]] = []
    try:
        views = {n: backend.with_sampling(max_new_tokens=n) for n in bucket_lengths(args)}
        work = build_workload(args, model.vocab_size)
        warm = pad_prompts(
            random_prompts(random.Random(-1), 2 * replicas, model.vocab_size), "left"
        )
        backend.generate(warm)  # first-call costs stay out of the timings
        for run in (run_serial, run_threads, run_async):
            try:
                r = run(views, work)
            except Exception as error:
                print(f"  {run.__name__} failed: {type(error).__name__}: {error}", flush=True)
                continue
            modes.append(
                {
                    "replicas": replicas,
                    "mode": r.mode,
                    "rows": r.rows,
                    "tokens": r.tokens,
                    "seconds": r.seconds,
                    "tokens_s": r.tokens / r.seconds,
                    "first_row_s": r.first_row_s,
                }
            )
            print(
                f"  {r.mode:18s} {r.rows} rows {r.tokens} tokens in {r.seconds:6.2f} s: "
                f"{r.tokens / r.seconds:7.1f} tokens/s, first row after {r.first_row_s:.2f} s",
                flush=True,
            )
        refitter = Refitter(backend)

        def refit() -> None:
            refitter.refit(weights, in_flight="keep")

        for loop_refit in (None, refit):
            r2 = serve_loop(views, args, model.vocab_size, loop_refit)
            mean = sum(r2.refit_times) / len(r2.refit_times) if r2.refit_times else float("nan")
            loops.append(
                {
                    "replicas": replicas,
                    "refitting": r2.refitting,
                    "seconds": r2.seconds,
                    "rows": r2.rows,
                    "rows_s": r2.rows / r2.seconds,
                    "refits": len(r2.refit_times),
                    "refit_s": mean,
                    "mixed_rows": r2.mixed_rows,
                }
            )
            print(
                f"  loop {'with' if r2.refitting else 'without'} refits: {r2.rows} rows in "
                f"{r2.seconds:.1f} s ({r2.rows / r2.seconds:.2f} rows/s), "
                f"{len(r2.refit_times)} refits (mean {mean:.2f} s), "
                f"{r2.mixed_rows} rows saw 2+ versions",
                flush=True,
            )
            for error in r2.errors:
                print(f"    {error}", flush=True)
        refitter.close()
    finally:
        backend.shutdown()
    return modes, loops


def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    args = parse_args()
    began = time.perf_counter()
    model = build_tiny_model(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    weights = {
        k: (v + 1e-3 * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
        for k, v in model.state_dict().items()
    }
    print(
        f"{args.model}: {model.spec.parameter_count() / 1e6:.0f}M parameters; buckets "
        f"{bucket_lengths(args)} max_new_tokens; {args.rows} rows",
        flush=True,
    )
    modes: list[dict[str, Any]] = []
    loops: list[dict[str, Any]] = []
    for replicas in (int(x) for x in args.replicas.split(",")):
        m, lo = measure(replicas, model, weights, args)
        modes.extend(m)
        loops.extend(lo)
    print()
    print("| replicas | mode | rows | tokens | s | tokens/s | first row s |")
    print("|---|---|---|---|---|---|---|")
    for r in modes:
        print(
            f"| {r['replicas']} | {r['mode']} | {r['rows']} | {r['tokens']} | {r['seconds']:.2f} "
            f"| {r['tokens_s']:.1f} | {r['first_row_s']:.2f} |"
        )
    print()
    print(
        "| replicas | refits in flight | s | rows served | rows/s | refits | mean refit s "
        "| rows with 2+ versions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in loops:
        print(
            f"| {r['replicas']} | {'yes' if r['refitting'] else 'no'} | {r['seconds']:.1f} | "
            f"{r['rows']} | {r['rows_s']:.2f} | {r['refits']} | {r['refit_s']:.2f} | "
            f"{r['mixed_rows']} |"
        )
    print(f"\ntotal run time {time.perf_counter() - began:.0f} s")
    return modes, loops


if __name__ == "__main__":
    main()
