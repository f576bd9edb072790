"""One OpenAI-client workload against ``vllm serve`` and ``gen-serve --backend vllm``, in
interleaved pairs: generated tokens per second and time to first token.

    uv run python tools/bench/serve.py [--model bench-step] [--requests 64] [--new 16,128] \
        [--prompt 8,96] [--pairs 5] [--servers vllm-serve,gen-serve]
    uv run python tools/bench/serve.py --requests 8,16,32,64 --plot serve.png   # curves

Every server runs in a process of its own on 127.0.0.1 (a free port), all of them at once, on the
same random float32 testkit model, with one CPU engine, a 1 GiB KV cache and the same context
limit. vLLM's server is ``python -m vllm.entrypoints.openai.api_server`` (its ``vllm`` command
cannot start from the CPU build) with the settings gen-vllm uses on CPU: ``--enforce-eager
--no-enable-chunked-prefill --seed 0 --max-model-len 512``, ``VLLM_CPU_KVCACHE_SPACE=1``
(``vllm-serve-chunked-prefill``: the same with vLLM's default chunked prefill).

Workload, the same for every server (fixed seed): ``--requests`` concurrent streaming
``client.completions.create`` calls of the official ``openai`` client, each a prompt of random
token ids (``--prompt`` lengths) and its own ``max_tokens`` drawn uniformly from ``--new``,
sampled at temperature 1 with a seed of its own and ``ignore_eos`` (so every request runs to its
length), usage reported in the last chunk. A request's time to first token is from sending it
to its first chunk with text or token ids. Each server answers 4 requests first (untimed); then
``--pairs`` rounds, each running the workload once on every server in turn (``vllm serve``
varies by up to 1.7x between runs here: interleaving lets the machine's drift fall on every
server alike). Reported per server: the median over rounds of generated tokens per wall second
(usage's ``completion_tokens``) and of the rounds' time to first token p50 and p99; and per round
the ratios to the first server, with their median and spread. Every run is bounded:
``--requests`` requests, ``--timeout`` seconds. A list of ``--requests`` measures every server at
each concurrency (the first requests of the same workload; one server start); ``--plot FILE``
draws the medians' throughput and time to first token against concurrency (``plots.serving``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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
from quiet import wait_until_quiet
from workloads import Work, random_requests

_NAME = "bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-step", help="testkit preset")
    parser.add_argument(
        "--requests",
        default="64",
        help="concurrent requests per run; a comma-separated list measures each",
    )
    parser.add_argument("--new", default="16,128", help="smallest,largest max_tokens")
    parser.add_argument("--prompt", default="8,96", help="shortest,longest prompt")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--servers",
        default="vllm-serve,gen-serve",
        help="comma-separated (vllm-serve, vllm-serve-chunked-prefill, gen-serve); ratios are "
        "to the first",
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


def workload(args: argparse.Namespace, vocab: int) -> Work:
    """The largest concurrency's requests; a smaller one runs the first of them."""
    return random_requests(max(args.concurrency), vocab, args.new, args.prompt, args.seed)


async def one_request(
    client: Any, prompt: list[int], max_tokens: int, seed: int
) -> tuple[float, int]:
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
        seed=seed,
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


async def run_workload(url: str, work: Work, timeout_s: float) -> Run:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", timeout=timeout_s, max_retries=0
    ) as client:
        start = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one_request(client, p, n, seed) for p, n, seed in work)), timeout_s
        )
        seconds = time.perf_counter() - start
    return Run(seconds, sum(n for _, n in results), [t for t, _ in results])


def server_for(name: str, model: TinyModel, args: argparse.Namespace, config: str) -> ServerProcess:
    port = free_port()
    if name in ("vllm-serve", "vllm-serve-chunked-prefill"):
        # gen-vllm runs its engines without chunked prefill on CPU (a seeded row's generator
        # cannot rewind there) and with seed 0; vLLM's server the same way, unless asked for
        # its default chunked prefill.
        extra = ["--seed", "0"]
        if name == "vllm-serve":
            extra.append("--no-enable-chunked-prefill")
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


Runs = dict[tuple[str, int], list[Run]]  # per (server, concurrency): one run per round


def measure(names: list[str], model: TinyModel, args: argparse.Namespace, config: str) -> Runs:
    """Start every server, warm each, then at each concurrency run the workload on each server
    in turn, ``--pairs`` times."""
    work = workload(args, model.vocab_size)
    servers: dict[str, ServerProcess] = {}
    try:
        for name in names:
            servers[name] = server_for(name, model, args, config)
            print(f"{name}: ready after {servers[name].wait_ready(600):.1f} s", flush=True)
            warm = [(p, 8, seed) for p, _, seed in work[:4]]
            asyncio.run(run_workload(servers[name].url, warm, args.timeout))
        runs: Runs = {}
        for concurrency in args.concurrency:
            for round_ in range(args.pairs):
                for name, server in servers.items():
                    requests = work[:concurrency]
                    wait_until_quiet()  # vLLM's worker polls for a second after a run
                    run = asyncio.run(run_workload(server.url, requests, args.timeout))
                    runs.setdefault((name, concurrency), []).append(run)
                    print(
                        f"  {concurrency} concurrent, round {round_ + 1} {name}: {run.tokens} "
                        f"tokens in {run.seconds:.2f} s: {run.tokens_s:.1f} tokens/s, time to "
                        f"first token p50 {run.ttft_quantile(0.5):.3f} s "
                        f"p99 {run.ttft_quantile(0.99):.3f} s",
                        flush=True,
                    )
        return runs
    finally:
        for server in servers.values():
            server.stop()


def main() -> Runs:
    args = parse_args()
    model = build_tiny_model(args.model)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"vllm_cfg": {"cpu_kv_cache_gib": 1.0}}, f)
        config = f.name
    print(
        f"{args.model}: {model.spec.parameter_count() / 1e6:.1f}M parameters; {args.requests} "
        f"concurrent streaming requests, max_tokens {args.new}, prompts {args.prompt}, "
        f"{args.pairs} interleaved rounds",
        flush=True,
    )
    names = args.servers.split(",")
    runs = measure(names, model, args, config)
    print()
    print(
        "| server | tokens/s (median) | TTFT p50 s | TTFT p99 s | tokens/s ratio (spread) "
        "| TTFT p50 ratio (spread) |"
    )
    print("|---|---|---|---|---|---|")
    points = []
    for concurrency in args.concurrency:
        reference = runs[names[0], concurrency]
        for name in names:
            mine = runs[name, concurrency]
            tps = [r.tokens_s / ref.tokens_s for r, ref in zip(mine, reference)]
            p50 = [r.ttft_quantile(0.5) / ref.ttft_quantile(0.5) for r, ref in zip(mine, reference)]
            point = {
                "server": name,
                "concurrency": concurrency,
                "tokens_s": statistics.median(r.tokens_s for r in mine),
                "ttft_p50_s": statistics.median(r.ttft_quantile(0.5) for r in mine),
                "ttft_p99_s": statistics.median(r.ttft_quantile(0.99) for r in mine),
            }
            points.append(point)
            label = name if len(args.concurrency) == 1 else f"{name}, {concurrency} concurrent"
            print(
                f"| {label} | {point['tokens_s']:.0f} | {point['ttft_p50_s']:.3f} "
                f"| {point['ttft_p99_s']:.3f} "
                f"| {statistics.median(tps):.2f} ({min(tps):.2f}-{max(tps):.2f}) "
                f"| {statistics.median(p50):.2f} ({min(p50):.2f}-{max(p50):.2f}) |"
            )
    if args.plot:
        import plots

        title = f"{args.model}, max_tokens {args.new}, the median of {args.pairs} rounds"
        print(f"wrote {plots.serving(points, args.plot, title)}")
    return runs


if __name__ == "__main__":
    main()
