"""One OpenAI-client workload against ``vllm serve`` and ``gen-serve --backend vllm``, side by
side: generated tokens per second and time to first token.

    uv run python tools/bench/serve.py [--model bench-50m] [--requests 64] [--new 16,256] \
        [--repeats 2] [--servers vllm-serve,vllm-serve-no-chunked-prefill,gen-serve]
    uv run python tools/bench/serve.py --requests 8,16,32,64 --plot serve.png   # curves

Each server runs in a process of its own on 127.0.0.1 (a free port), one at a time, on the same
random float32 testkit model, with one CPU engine, a 1 GiB KV cache and the same context limit.
vLLM's server is ``python -m vllm.entrypoints.openai.api_server`` (its ``vllm`` command cannot
start from the CPU build) with its own defaults otherwise.

Workload, the same for both (fixed seed): ``--requests`` concurrent streaming
``client.completions.create`` calls of the official ``openai`` client, each a prompt of random
token ids (16-128 tokens) and its own ``max_tokens`` drawn uniformly from ``--new``, sampled at
temperature 1 with ``ignore_eos`` (so every request runs to its length), usage reported in the
last chunk. A request's time to first token is from sending it to its first chunk with text or
token ids. Each server answers 4 requests first (untimed), then the workload ``--repeats``
times; reported: the fastest run's generated tokens per wall second (usage's
``completion_tokens``), and time to first token p50 and p99 over that run's requests, with
ratios to the first server (``vllm serve``). Every run is bounded: ``--requests`` requests,
``--timeout`` seconds. A list of ``--requests`` measures each server at each concurrency (one
server start, the first requests of the same workload); ``--plot FILE`` draws throughput and
time to first token against concurrency (``plots.serving``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from gen_testkit.models import TinyModel, build_tiny_model
from gen_testkit.servers import (
    VLLM_SERVE_ENV,
    ServerProcess,
    free_port,
    gen_serve_command,
    vllm_serve_command,
)

_NAME = "bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-50m", help="testkit preset")
    parser.add_argument(
        "--requests",
        default="64",
        help="concurrent requests per run; a comma-separated list measures each",
    )
    parser.add_argument("--new", default="16,256", help="smallest,largest max_tokens")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per server")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--servers",
        default="vllm-serve,vllm-serve-no-chunked-prefill,gen-serve",
        help="comma-separated; ratios are to the first",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE", help="draw the curves into this PNG")
    args = parser.parse_args()
    args.concurrency = [int(n) for n in args.requests.split(",")]
    return args


@dataclass
class Run:
    seconds: float
    tokens: int
    ttft: list[float]

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds

    def ttft_quantile(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The largest concurrency's requests; a smaller one runs the first of them."""
    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.new.split(","))
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))], rng.randint(low, high))
        for _ in range(max(args.concurrency))
    ]


async def one_request(client: Any, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """Stream one completion; its time to first token and its generated-token count."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    stream = await client.completions.create(
        model=_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        if first is None and any(c.text or getattr(c, "token_ids", None) for c in chunk.choices):
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        raise RuntimeError("a request streamed no token")
    return first, tokens


async def run_workload(url: str, work: list[tuple[list[int], int]], timeout_s: float) -> Run:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", timeout=timeout_s, max_retries=0
    ) as client:
        start = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one_request(client, p, n) for p, n in work)), timeout_s
        )
        seconds = time.perf_counter() - start
    return Run(seconds, sum(n for _, n in results), [t for t, _ in results])


def server_for(name: str, model: TinyModel, args: argparse.Namespace, config: str) -> ServerProcess:
    port = free_port()
    if name in ("vllm-serve", "vllm-serve-no-chunked-prefill"):
        # gen-vllm runs its engines without chunked prefill on CPU (a seeded row's generator
        # cannot rewind there); the second server measures vLLM's own server the same way.
        extra = ["--no-enable-chunked-prefill"] if name != "vllm-serve" else []
        command = vllm_serve_command(
            model.path,
            port,
            max_model_len=args.max_model_len,
            served_model_name=_NAME,
            extra=extra,
        )
        return ServerProcess(command, port, env=VLLM_SERVE_ENV, name=name)
    command = gen_serve_command(
        "vllm",
        model.path,
        port,
        served_model_name=_NAME,
        extra=["--config", config, "--max-model-len", str(args.max_model_len)],
    )
    return ServerProcess(command, port, env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, name=name)


def measure(
    name: str, model: TinyModel, args: argparse.Namespace, config: str
) -> dict[int, list[Run]]:
    """Every run of one server, by concurrency."""
    work = workload(args, model.vocab_size)
    server = server_for(name, model, args, config)
    try:
        print(f"{name}: ready after {server.wait_ready(600):.1f} s", flush=True)
        asyncio.run(run_workload(server.url, [(p, 8) for p, _ in work[:4]], args.timeout))
        runs: dict[int, list[Run]] = {}
        for concurrency in args.concurrency:
            if len(args.concurrency) > 1:
                print(f" {concurrency} concurrent requests", flush=True)
            for _ in range(args.repeats):
                run = asyncio.run(run_workload(server.url, work[:concurrency], args.timeout))
                runs.setdefault(concurrency, []).append(run)
                print(
                    f"  {run.tokens} tokens in {run.seconds:.2f} s: {run.tokens_s:.1f} tokens/s, "
                    f"time to first token p50 {run.ttft_quantile(0.5):.3f} s "
                    f"p99 {run.ttft_quantile(0.99):.3f} s",
                    flush=True,
                )
        return runs
    finally:
        server.stop()


def main() -> dict[str, Run]:
    args = parse_args()
    model = build_tiny_model(args.model)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"vllm_cfg": {"cpu_kv_cache_gib": 1.0}}, f)
        config = f.name
    print(
        f"{args.model}: {model.spec.parameter_count() / 1e6:.0f}M parameters; {args.requests} "
        f"concurrent streaming requests, max_tokens {args.new}",
        flush=True,
    )
    best: dict[tuple[str, int], Run] = {}
    for name in args.servers.split(","):
        for concurrency, runs in measure(name, model, args, config).items():
            best[name, concurrency] = max(runs, key=lambda r: r.tokens_s)
    print()
    print(
        "| server | tokens/s | TTFT p50 s | TTFT p99 s | tokens/s ratio | TTFT p50 ratio "
        "| TTFT p99 ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for (name, concurrency), run in best.items():
        reference = next(r for (_, c), r in best.items() if c == concurrency)
        p50, p99 = run.ttft_quantile(0.5), run.ttft_quantile(0.99)
        ratios = (
            f"{run.tokens_s / reference.tokens_s:.2f} | "
            f"{p50 / reference.ttft_quantile(0.5):.2f} | {p99 / reference.ttft_quantile(0.99):.2f}"
        )
        label = name if len(args.concurrency) == 1 else f"{name}, {concurrency} concurrent"
        print(f"| {label} | {run.tokens_s:.1f} | {p50:.3f} | {p99:.3f} | {ratios} |")
    if args.plot:
        import plots

        points = [
            {
                "server": name,
                "concurrency": concurrency,
                "tokens_s": run.tokens_s,
                "ttft_p50_s": run.ttft_quantile(0.5),
                "ttft_p99_s": run.ttft_quantile(0.99),
            }
            for (name, concurrency), run in best.items()
        ]
        runs = f"{args.repeats} run" + ("s" if args.repeats != 1 else "")
        title = f"{args.model}, max_tokens {args.new}, the fastest of {runs}"
        print(f"wrote {plots.serving(points, args.plot, title)}")
    return {
        name if len(args.concurrency) == 1 else f"{name}@{c}": r for (name, c), r in best.items()
    }


if __name__ == "__main__":
    main()
