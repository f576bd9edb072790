"""Conversation affinity: 3-turn conversations on 2 vLLM replicas behind gen-serve, with and
without session keys, side by side in one run.

    uv run python tools/bench/affinity.py [--model bench-50m] [--conversations 16] \
        [--prompt 512] [--turn 64] [--new 32]

One ``gen-serve --backend vllm --replicas 2`` process on 127.0.0.1 (a free port), prefix caching
on (gen-vllm's default), a 1 GiB KV cache per replica. Each conversation: a prompt of
``--prompt`` random token ids, then two more turns, each the previous turn's prompt and answer
plus ``--turn`` new ids (the next user message); every answer ``--new`` sampled tokens
(``ignore_eos``). All conversations send their turn k at once, in a random order (replies
do not come back in lockstep), streamed through
``/inference/v1/generate``; turn k+1 starts when every turn k ended. The two workloads use
different prompts, run one after the other on the same server, prefix cache reset before each:
first without session keys (every row to the least-loaded replica), then with
``session_id`` = the conversation. Reported per turn: time to first token (mean, p90) and the
share of prompt tokens found in the replicas' prefix caches, from vLLM's own
``num_cached_tokens`` per request (``prefix_cache_hits_total`` / ``prefix_cache_queries_total``
of the backend's metrics). Bounded: 3 x ``--conversations`` requests per workload, and
``--timeout`` seconds per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx
from gen_testkit.models import build_tiny_model
from gen_testkit.servers import ServerProcess, free_port, gen_serve_command

_NAME = "bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-50m", help="a testkit preset")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512, help="first turn's prompt tokens")
    parser.add_argument("--turn", type=int, default=64, help="new tokens of each later turn")
    parser.add_argument("--new", type=int, default=32, help="tokens of every answer")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per turn at most")
    return parser.parse_args()


@dataclass
class Turn:
    """One turn of every conversation: time to first token of each, prefix-cache counts."""

    ttft: list[float] = field(default_factory=list)
    hits: int = 0
    queries: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


async def one_turn(
    client: httpx.AsyncClient, prompt: list[int], new: int, seed: int, session: str | None
) -> tuple[float, list[int]]:
    """Stream one answer; returns (time to first token, the answer's ids)."""
    body: dict = {
        "token_ids": prompt,
        "stream": True,
        "sampling_params": {
            "max_tokens": new,
            "temperature": 1.0,
            "seed": seed,
            "ignore_eos": True,
        },
    }
    if session is not None:
        body["session_id"] = session
    start = time.perf_counter()
    first: float | None = None
    answer: list[int] = []
    async with client.stream("POST", "/inference/v1/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("token_ids"):
                    first = first if first is not None else time.perf_counter() - start
                    answer += choice["token_ids"]
    assert first is not None and len(answer) == new, "an answer came back short"
    return first, answer


def cache_counts(client: httpx.Client) -> tuple[int, int]:
    """(hits, queries) of the backend's prefix-cache counters, from ``/metrics``."""
    text = client.get("/metrics").text

    def value(name: str) -> int:
        match = re.search(rf"^gen:backend_{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert match, f"the server reports no {name}"
        return int(float(match.group(1)))

    return value("prefix_cache_hits_total"), value("prefix_cache_queries_total")


def workload(url: str, args: argparse.Namespace, seed: int, sessions: bool) -> list[Turn]:
    rng = random.Random(seed)
    vocab = build_tiny_model(args.model).vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.conversations)
    ]
    turns = []
    with httpx.Client(base_url=url, timeout=60) as control:
        assert control.post("/reset_prefix_cache").json()["success"]
        for k in range(3):
            before = cache_counts(control)

            order = list(range(len(prompts)))
            rng.shuffle(order)  # conversations do not come back in lockstep, nor in order

            async def turn(
                prompts: list[list[int]] = prompts, k: int = k, order: list[int] = order
            ) -> list:
                limits = httpx.Limits(max_connections=args.conversations)
                async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                    return await asyncio.wait_for(
                        asyncio.gather(
                            *(
                                one_turn(
                                    client,
                                    prompts[c],
                                    args.new,
                                    seed * 1000 + 10 * c + k,
                                    f"conversation-{seed}-{c}" if sessions else None,
                                )
                                for c in order
                            )
                        ),
                        args.timeout,
                    )

            answered = asyncio.run(turn())
            results = [answered[order.index(c)] for c in range(len(prompts))]
            after = cache_counts(control)
            turns.append(Turn([t for t, _ in results], after[0] - before[0], after[1] - before[1]))
            prompts = [
                p + answer + [rng.randrange(3, vocab) for _ in range(args.turn)]
                for p, (_, answer) in zip(prompts, results)
            ]
    return turns


def main() -> dict[str, list[Turn]]:
    args = parse_args()
    model = build_tiny_model(args.model)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"vllm_cfg": {"cpu_kv_cache_gib": 1.0}}, f)
        config = f.name
    port = free_port()
    longest = args.prompt + 3 * (args.new + args.turn)
    command = gen_serve_command(
        "vllm",
        model.path,
        port,
        served_model_name=_NAME,
        extra=["--replicas", "2", "--config", config, "--max-model-len", str(longest + 64)],
    )
    server = ServerProcess(
        command, port, env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, name="gen-serve"
    )
    results: dict[str, list[Turn]] = {}
    try:
        print(f"gen-serve, 2 replicas: ready after {server.wait_ready(900):.1f} s", flush=True)
        workload(server.url, argparse.Namespace(**{**vars(args), "conversations": 2}), 99, False)
        for name, seed, sessions in (("least-loaded", 1, False), ("session keys", 2, True)):
            results[name] = workload(server.url, args, seed, sessions)
            for k, turn in enumerate(results[name]):
                print(
                    f"{name}, turn {k + 1}: TTFT mean {statistics.mean(turn.ttft):.3f} s, "
                    f"prefix-cache hits {turn.hits}/{turn.queries} ({turn.hit_rate:.0%})",
                    flush=True,
                )
    finally:
        server.stop()
    print()
    print("| routing | turn | TTFT mean s | TTFT p90 s | prefix-cache hit rate |")
    print("|---|---|---|---|---|")
    for name, turns in results.items():
        for k, turn in enumerate(turns):
            p90 = statistics.quantiles(turn.ttft, n=10)[-1] if len(turn.ttft) > 1 else turn.ttft[0]
            print(
                f"| {name} | {k + 1} | {statistics.mean(turn.ttft):.3f} | {p90:.3f} | "
                f"{turn.hit_rate:.0%} |"
            )
    return results


if __name__ == "__main__":
    main()
