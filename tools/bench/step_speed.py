"""gen-vllm against bare vLLM where a decode step is fast: what the layer adds per step and row.

    uv run python tools/bench/step_speed.py [--model bench-step] [--batches 1,64,256]
        [--modes generate,async,stream] [--pairs 5] [--new 128] [--replicas 1]
        [--cpu-threads N] [--json FILE]

On a testkit model (``bench-step``, the default: a Llama of hidden 128 whose vLLM decode step
over 64 rows takes 10-30 ms on two cores, a GPU's order for a 7B model; ``bench-50m``: the
older benchmark model, whose slow step hides what the layer adds; run once per model), one
engine of each kind, all with the engine settings gen-vllm uses on CPU (float32, eager, chunked
prefill off, a 1 GiB KV cache, prefix caching on but reset before every run, vLLM's statistics
off (``AsyncLLM`` too: ``LLM`` and gen-vllm turn them off); gen-vllm's
engine threads by its own rule unless ``--cpu-threads`` says (every core but one, every core
while 16 or more rows run and none streams), bare vLLM's by torch's default):

- ``generate``: ``VllmGeneration.generate`` against vLLM's ``LLM.generate`` (in this process);
- ``async``: ``generate_async`` (rows as they finish) against vLLM's ``AsyncLLM`` with
  ``FINAL_ONLY`` outputs (its engine core in a process of its own, as vLLM runs it);
- ``stream``: ``generate_stream`` (tokens as they come) against ``AsyncLLM`` with ``DELTA``
  outputs, every request consumed concurrently.

Workload, the same for both sides of a pair: ``batch`` prompts of 8-96 random ids (fixed seed),
each sampled at temperature 1 with a seed of its own, exactly ``--new`` tokens (no stop token),
one logprob per token. Each figure is the median of ``--pairs`` interleaved pairs (bare, then
ours), with the spread (min-max) of the pairs' ratios: vLLM on this CPU varies by up to 1.7x
between runs, and interleaving lets the machine's drift fall on both sides alike. At batch 1 the
figure that matters is latency (seconds for the row); the ratio is the same number inverted.

Per-step delivery: for every run of ours, gen-vllm's own ``step_to_caller_seconds`` (from the end
of the engine step that made a row's tokens or result to their arrival at the caller), p50 and
p99, against the bare step time (bare wall time / steps); and its first hop alone, p50 of
``step_to_driver_seconds`` (to this process's router: the worker's hand-over and Ray's message),
so that the rest is this process's routing and hand-over to the caller. Bare vLLM's own delivery
is measured the same way, from the same point (vLLM's stamp on the engine core's outputs of a
step, taken as the scheduler has the step's results and before any output is built): to the
return of ``LLMEngine.step`` with rows that ended (``generate``, one process), or to each
request's consumer (``AsyncLLM``, its engine core in a process of its own). What the layer adds
per step is the difference. Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch
from gen_interface import BatchedDataDict
from gen_testkit.models import build_tiny_model
from gen_vllm.delivery import DeliveryTimes
from gen_vllm.engine_loop import WIDE_ROWS
from gen_vllm.worker import engine_threads
from quiet import wait_until_quiet
from workloads import left_padded, sampled_config

T = TypeVar("T")

_KV_BYTES = 1 << 30
_ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "enable_chunked_prefill": False,
    "enable_prefix_caching": True,
    "kv_cache_memory_bytes": _KV_BYTES,
    "seed": 0,
    "max_num_seqs": 256,
    "max_logprobs": 20,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-step", help="testkit preset")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--modes", default="generate,async,stream")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs per figure")
    parser.add_argument("--new", type=int, default=128, help="tokens per row")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--cpu-threads", type=int, help="gen-vllm's vllm_cfg.cpu_threads (default: its own rule)"
    )
    parser.add_argument("--json", help="write every run's figures here")
    return parser.parse_args()


@dataclass
class Figure:
    """One (model, mode, batch): every pair's runs."""

    model: str
    mode: str
    batch: int
    bare_seconds: list[float] = field(default_factory=list)
    ours_seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    delivery_p50: list[float] = field(default_factory=list)
    delivery_p99: list[float] = field(default_factory=list)
    driver_p50: list[float] = field(default_factory=list)
    bare_delivery_p50: list[float] = field(default_factory=list)
    bare_delivery_p99: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """Per pair: ours tokens/s over bare tokens/s (bare seconds / ours seconds)."""
        return [b / o for b, o in zip(self.bare_seconds, self.ours_seconds)]

    def row(self, steps: int) -> str:
        bare = [self.tokens / s for s in self.bare_seconds]
        ours = [self.tokens / s for s in self.ours_seconds]
        ratios = self.ratios()
        bare_step = statistics.median(self.bare_seconds) / steps
        p50 = statistics.median(self.delivery_p50) if self.delivery_p50 else float("nan")
        p99 = statistics.median(self.delivery_p99) if self.delivery_p99 else float("nan")
        driver = statistics.median(self.driver_p50) if self.driver_p50 else float("nan")
        bare_p50 = statistics.median(self.bare_delivery_p50)
        bare_p99 = statistics.median(self.bare_delivery_p99)
        bare_s, ours_s = statistics.median(self.bare_seconds), statistics.median(self.ours_seconds)
        latency = f"{bare_s:.3f} / {ours_s:.3f} s" if self.batch == 1 else "-"
        return (
            f"| {self.model} | {self.mode} | {self.batch} | {statistics.median(bare):.0f} "
            f"| {statistics.median(ours):.0f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {latency} | {bare_step * 1e3:.1f} ms "
            f"| {driver * 1e3:.2f} ms | {p50 * 1e3:.2f} / {p99 * 1e3:.2f} ms "
            f"| {bare_p50 * 1e3:.2f} / {bare_p99 * 1e3:.2f} ms | {p50 / bare_step:.3f} "
            f"| {(p50 - bare_p50) / bare_step:.3f} |"
        )


def workload(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 96))] for _ in range(batch)]


class LoopThread:
    """An event loop on a thread of its own (vLLM's ``AsyncLLM`` keeps tasks on the loop that
    built it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class Bare:
    """vLLM's own engines: ``LLM`` for whole calls, ``AsyncLLM`` for rows and tokens; each
    records its own delivery (``deliveries``, gen-vllm's ``DeliveryTimes``: seconds from a
    step's stamp to where its rows' tokens or results reach the caller, for the last run)."""

    def __init__(self, model: str, modes: list[str]):
        from vllm import LLM, AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.deliveries = DeliveryTimes("bare")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = LLM(model=model, skip_tokenizer_init=True, **_ENGINE)
        self._time_llm_steps(self.llm.llm_engine)
        self.loop: LoopThread | None = None
        if {"async", "stream"} & set(modes):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            self.loop = LoopThread()
            # vLLM's statistics off, as in ``LLM`` and gen-vllm's engines: on, they cost
            # ``AsyncLLM`` a Prometheus observation per row per step
            args = AsyncEngineArgs(
                model=model, skip_tokenizer_init=True, disable_log_stats=True, **_ENGINE
            )
            self.async_llm = self.loop.run(_build_async(AsyncLLM, args))
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            self.stamps = self._stamp_async_outputs(self.async_llm.output_processor)

    def _time_llm_steps(self, engine: Any) -> None:
        """``LLMEngine`` (one process): each step that returns rows is a delivery, from its
        core outputs' stamp to the step's return."""
        core, step = engine.engine_core, engine.step
        stamp = [0.0]

        def get_output() -> Any:
            outputs = fetch()
            stamp[0] = outputs.timestamp
            return outputs

        def timed_step() -> Any:
            outputs = step()
            if outputs:
                self.deliveries.record(time.monotonic() - stamp[0])
            return outputs

        fetch = core.get_output
        core.get_output = get_output
        engine.step = timed_step

    @staticmethod
    def _stamp_async_outputs(processor: Any) -> dict[str, float]:
        """``AsyncLLM``: the stamp of the step that made each request's latest output, by the
        request's own id, as the front-end process takes the engine core's outputs."""
        stamps: dict[str, float] = {}
        process = processor.process_outputs

        def stamped(outputs: Any, timestamp: float, *args: Any, **kwargs: Any) -> Any:
            states = processor.request_states
            for output in outputs:
                state = states.get(output.request_id)
                if state is not None:
                    stamps[state.external_req_id] = timestamp
            return process(outputs, timestamp, *args, **kwargs)

        processor.process_outputs = stamped
        return stamps

    def run(self, mode: str, prompts: list[list[int]], new: int) -> float:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if mode == "stream" else RequestOutputKind.FINAL_ONLY
        params = [
            SamplingParams(
                max_tokens=new,
                temperature=1.0,
                seed=1000 + i,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                output_kind=kind,
            )
            for i in range(len(prompts))
        ]
        self.deliveries.clear()
        if mode == "generate":
            self.llm.reset_prefix_cache()
            start = time.perf_counter()
            self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return time.perf_counter() - start
        assert self.loop is not None
        self.loop.run(self.async_llm.reset_prefix_cache())
        return self.loop.run(
            _run_async(self.async_llm, prompts, params, self.stamps, self.deliveries)
        )

    def delivery(self) -> tuple[float, float]:
        """The last run's delivery p50 and p99, in seconds."""
        times = self.deliveries.snapshot()
        return times["bare_seconds_p50"], times["bare_seconds_p99"]

    def close(self) -> None:
        if self.loop is not None:
            self.async_llm.shutdown()


async def _build_async(cls: Any, args: Any) -> Any:
    return cls.from_engine_args(args)


async def _run_async(
    engine: Any,
    prompts: list[list[int]],
    params: list[Any],
    stamps: dict[str, float],
    deliveries: DeliveryTimes,
) -> float:
    async def one(prompt: list[int], p: Any) -> None:
        request_id = uuid.uuid4().hex
        async for _ in engine.generate({"prompt_token_ids": prompt}, p, request_id):
            deliveries.record(time.monotonic() - stamps[request_id])
        del stamps[request_id]

    start = time.perf_counter()
    await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params)))
    return time.perf_counter() - start


class Ours:
    """``VllmGeneration`` with ``replicas`` engines."""

    def __init__(self, model: str, replicas: int, new: int, cpu_threads: int | None = None):
        from gen_vllm import RayVirtualCluster, VllmGeneration

        self.cluster = RayVirtualCluster([replicas])
        self.backend = VllmGeneration(
            self.cluster,
            sampled_config(
                "vllm",
                model,
                new,
                colocated={"enabled": False},
                vllm_cfg={
                    "cpu_kv_cache_gib": _KV_BYTES / (1 << 30),
                    **({"cpu_threads": cpu_threads} if cpu_threads else {}),
                },
            ),
        )
        self.loop = LoopThread()

    def run(self, mode: str, batch: BatchedDataDict[Any]) -> tuple[float, dict[str, float]]:
        self.backend.invalidate_kv_cache()
        self.backend.clear_logger_metrics()
        start = time.perf_counter()
        if mode == "generate":
            self.backend.generate(batch)
        else:
            self.loop.run(self._drain(mode, batch))
        seconds = time.perf_counter() - start
        return seconds, self.backend.get_logger_metrics()

    async def _drain(self, mode: str, batch: BatchedDataDict[Any]) -> None:
        rows = self.backend.generate_async if mode == "async" else self.backend.generate_stream
        async for _ in rows(batch):
            pass

    def close(self) -> None:
        self.backend.shutdown()
        self.cluster.shutdown()


def measure(model_name: str, args: argparse.Namespace) -> list[Figure]:
    model = build_tiny_model(model_name)
    modes = args.modes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{model_name}: starting engines", flush=True)
    bare = Bare(str(model.path), modes)
    ours = Ours(str(model.path), args.replicas, args.new, args.cpu_threads)
    share = max(1, len(os.sched_getaffinity(0)) // args.replicas)
    narrow = engine_threads(share, args.cpu_threads)
    wide = (
        ""
        if args.cpu_threads or share == narrow
        else f" ({share} from {WIDE_ROWS} rows, none streaming)"
    )
    print(
        f"forward-pass threads: bare LLM {torch.get_num_threads()}, "
        f"gen-vllm {narrow}{wide} per replica",
        flush=True,
    )
    figures = []
    try:
        for mode in modes:
            for size in batches:
                prompts = workload(size, model.vocab_size)
                batch = left_padded(prompts)
                figure = Figure(model_name, mode, size, tokens=size * args.new)
                bare.run(mode, prompts, args.new)  # warm-up, each side
                ours.run(mode, batch)
                for _ in range(args.pairs):
                    wait_until_quiet()  # vLLM's worker polls for a second after a run
                    figure.bare_seconds.append(bare.run(mode, prompts, args.new))
                    p50, p99 = bare.delivery()
                    figure.bare_delivery_p50.append(p50)
                    figure.bare_delivery_p99.append(p99)
                    wait_until_quiet()
                    seconds, metrics = ours.run(mode, batch)
                    figure.ours_seconds.append(seconds)
                    if "step_to_caller_seconds_p50" in metrics:
                        figure.delivery_p50.append(metrics["step_to_caller_seconds_p50"])
                        figure.delivery_p99.append(metrics["step_to_caller_seconds_p99"])
                    if "step_to_driver_seconds_p50" in metrics:
                        figure.driver_p50.append(metrics["step_to_driver_seconds_p50"])
                print(figure.row(args.new), flush=True)
                figures.append(figure)
    finally:
        ours.close()
        bare.close()
    return figures


def main() -> list[Figure]:
    args = parse_args()
    print(
        "| model | mode | batch | bare tok/s | ours tok/s | ratio (spread) | batch-1 latency "
        "bare / ours | bare step | to driver p50 | delivery p50 / p99 | bare's delivery p50 / p99 "
        "| p50 / step | added p50 / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    figures = measure(args.model, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(f) for f in figures], out, indent=1)
    return figures


if __name__ == "__main__":
    main()
