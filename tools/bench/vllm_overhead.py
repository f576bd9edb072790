"""What the Ray orchestration costs: VllmGeneration against a bare vllm.LLM, side by side.

    uv run python tools/bench/vllm_overhead.py [--model DIR] [--batch 32] [--prompt 32] [--new 64]
        [--startup-only] [--bare-chunked-prefill] [--greedy]

On one model and one set of inputs, in one run: tokens per second of a bare ``vllm.LLM.generate``
(in this process, the engine settings VllmGeneration uses on CPU: chunked prefill off, since
vLLM's rewinding of a chunked row's seeded generator fails on CPU; ``--bare-chunked-prefill``
gives the bare engine vLLM's default instead, to measure what turning it off costs, which only
runs while a call's prompt tokens fit one step or with ``--greedy``), of ``VllmGeneration`` with
one replica, and of
``VllmGeneration`` with two replicas, each run alternating with the bare engine's so that load
from elsewhere falls on both alike. Sampled generation with a seed per row, exactly ``--new``
tokens per row (no stop tokens), float32.

Start-up is timed in fresh processes, from the interpreter's start to the first generated token:
a bare ``vllm.LLM``; the same bare ``vllm.LLM`` built inside a plain Ray actor of a Ray the process
starts (``ray.init``, a placement group, one actor: the floor of any design that runs its engine
in a Ray actor, as NeMo RL does, with none of this project's code); ``VllmGeneration`` starting
Ray itself; and ``VllmGeneration`` joining a Ray that is already running (as under a Ray-based
trainer). Prints tables and the ratios, to the bare engine and to the Ray floor.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
from gen_interface import BatchedDataDict
from workloads import sampled_config

#: A bare ``vllm.LLM`` with the engine settings VllmGeneration uses, and its first token.
_BARE_ENGINE = """
import os, sys

def bare_first_token(model, kv_gib):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=int(float(kv_gib) * (1 << 30)), seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, detokenize=False)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)  # as ours asks
"""

_BARE_START = (
    _BARE_ENGINE
    + """
bare_first_token(sys.argv[1], sys.argv[2])
print("FIRST TOKEN", flush=True)
"""
)

_RAY_FLOOR_START = (
    _BARE_ENGINE
    + """
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_worker_niceness", "0")  # as VllmGeneration's cluster sets it
import torch
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
ray.init(include_dashboard=False, log_to_driver=False)
cpus = int(ray.cluster_resources()["CPU"])  # the machine's cores, as VllmGeneration's one replica
group = placement_group([{"CPU": cpus}], strategy="STRICT_PACK")
ray.get(group.ready())
engine = ray.remote(bare_first_token).options(
    num_cpus=cpus,
    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group),
)
ray.get(engine.remote(sys.argv[1], sys.argv[2]))
print("FIRST TOKEN", flush=True)
ray.shutdown()
"""
)

_OURS_START = """
import os, sys
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
import torch
from gen_interface import BatchedDataDict
from gen_vllm import RayVirtualCluster, VllmGeneration
if sys.argv[3] == "join":
    import ray
    ray.init(address="auto", log_to_driver=False)
cluster = RayVirtualCluster([1])
config = {"backend": "vllm", "model_name": sys.argv[1], "max_new_tokens": 1, "temperature": 1.0,
          "top_p": 1.0, "stop_token_ids": [], "pad_token_id": 0, "dtype": "float32",
          "vllm_cfg": {"cpu_kv_cache_gib": float(sys.argv[2])}}
backend = VllmGeneration(cluster, config)
backend.generate(BatchedDataDict(input_ids=torch.tensor([[5, 6, 7]]),
                                 input_lengths=torch.tensor([3])), greedy=True)
print("FIRST TOKEN", flush=True)
backend.shutdown()
cluster.shutdown()
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the bench-50m tiny model)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each engine")
    parser.add_argument(
        "--startups", type=int, default=2, help="timed start-ups of each kind (0: none)"
    )
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument(
        "--bare-chunked-prefill",
        action="store_true",
        help="the bare engine with vLLM's default chunked prefill (VllmGeneration turns it off)",
    )
    parser.add_argument("--greedy", action="store_true", help="greedy instead of seeded sampling")
    parser.add_argument(
        "--startup-only", action="store_true", help="time the start-ups only, not throughput"
    )
    return parser.parse_args()


def interleaved(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs alternating so that load from elsewhere on the
    machine falls on all of them alike; one warm-up call each first."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bare_run(model: str, prompts: list[list[int]], args: argparse.Namespace) -> Callable[[], None]:
    """A bare in-process ``vllm.LLM`` and a call that samples ``prompts`` with it."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        seed=0,
        enable_chunked_prefill=args.bare_chunked_prefill,
    )
    params = [
        SamplingParams(
            max_tokens=args.new,
            temperature=0.0 if args.greedy else 1.0,
            seed=None if args.greedy else i,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        for i in range(len(prompts))
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]

    def run() -> None:
        llm.reset_prefix_cache()
        llm.generate(requests, params, use_tqdm=False)

    return run


@contextlib.contextmanager
def gen_vllm_run(
    model: str, batch: BatchedDataDict, replicas: int, args: argparse.Namespace
) -> Iterator[Callable[[], None]]:
    """A ``VllmGeneration`` of ``replicas`` engines and a call that samples ``batch`` with it."""
    from gen_vllm import RayVirtualCluster, VllmGeneration

    config = sampled_config(
        "vllm",
        model,
        args.new,
        colocated={"enabled": False},
        vllm_cfg={"cpu_kv_cache_gib": args.kv_gib},
    )
    cluster = RayVirtualCluster([replicas])
    backend = VllmGeneration(cluster, config)

    def run() -> None:
        backend.finish_generation()  # resets the prefix cache, as the bare run does
        backend.prepare_for_generation()
        out = backend.generate(batch, greedy=args.greedy)
        assert int(out["generation_lengths"].sum()) == len(batch["input_ids"]) * args.new

    try:
        yield run
    finally:
        backend.shutdown()
        cluster.shutdown()


#: The start-up of a bare ``vllm.LLM`` in a plain Ray actor of a Ray started for it.
_FLOOR = "bare vllm.LLM in a Ray actor, starting Ray"


def startup_seconds(script: str, *argv: str) -> float:
    """Seconds from starting a fresh interpreter to its printing FIRST TOKEN."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", script, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("FIRST TOKEN"):
            elapsed = time.perf_counter() - start
            process.wait(timeout=300)
            return elapsed
    raise RuntimeError(f"start-up run failed with exit code {process.wait()}")


def bench_startups(model: str, args: argparse.Namespace) -> dict[str, float]:
    """Median start-up seconds of each kind; none with ``--startups 0``."""
    if args.startups < 1:
        return {}
    kv = str(args.kv_gib)
    runs = range(args.startups)
    bare, floor, starting = [], [], []
    for _ in runs:  # alternating, so that drifting load falls on all alike
        bare.append(startup_seconds(_BARE_START, model, kv))
        floor.append(startup_seconds(_RAY_FLOOR_START, model, kv))
        starting.append(startup_seconds(_OURS_START, model, kv, "start"))
    out = {
        "bare vllm.LLM": statistics.median(bare),
        _FLOOR: statistics.median(floor),
        "VllmGeneration, starting Ray": statistics.median(starting),
    }
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    start_ray = [ray_cli, "start", "--head", "--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(start_ray, check=True, capture_output=True, env=env)
    try:
        out["VllmGeneration, Ray running"] = statistics.median(
            startup_seconds(_OURS_START, model, kv, "join") for _ in runs
        )
    finally:
        subprocess.run([ray_cli, "stop", "--force"], check=False, capture_output=True)
    return out


def main() -> None:
    args = parse_args()
    if args.model is None:
        from gen_testkit.models import build_tiny_model

        args.model = str(build_tiny_model("bench-50m").path)
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=generator)
    batch = BatchedDataDict(input_ids=ids, attention_mask=torch.ones_like(ids))
    tokens = args.batch * args.new
    print(
        f"model {args.model}\nbatch {args.batch}, prompt {args.prompt}, new {args.new}, "
        f"float32, {'greedy' if args.greedy else 'sampled'}, median of {args.repeats} after a "
        f"warm-up; bare engine chunked prefill {'on' if args.bare_chunked_prefill else 'off'}",
        flush=True,
    )
    if args.startup_only:
        print_startups(bench_startups(args.model, args))
        return
    bare = bare_run(args.model, ids.tolist(), args)
    with gen_vllm_run(args.model, batch, 1, args) as one:
        first = interleaved({"bare": bare, "one": one}, args.repeats)
    with gen_vllm_run(args.model, batch, 2, args) as two:
        second = interleaved({"bare": bare, "two": two}, args.repeats)
    bare_s, one_s, two_s = first["bare"], first["one"], second["two"]
    two_ratio = second["bare"] / two_s
    startups = bench_startups(args.model, args)

    print("\n| engine | tok/s | vs bare |\n|---|---|---|")
    for name, seconds, ratio in (
        ("bare vllm.LLM", bare_s, 1.0),
        ("VllmGeneration, 1 replica", one_s, bare_s / one_s),
        ("VllmGeneration, 2 replicas", two_s, two_ratio),
    ):
        print(f"| {name} | {tokens / seconds:.0f} | {ratio:.3f} |")
    print_startups(startups)
    print(f"\nthroughput, 1 replica / bare: {bare_s / one_s:.3f} (target >= 0.95)")


def print_startups(startups: dict[str, float]) -> None:
    if not startups:
        return
    bare, floor = startups["bare vllm.LLM"], startups[_FLOOR]
    print(
        "\n| start-up, fresh process to first token | s | vs bare | vs Ray floor |"
        "\n|---|---|---|---|"
    )
    for name, seconds in startups.items():
        print(f"| {name} | {seconds:.1f} | {seconds / bare:.2f} | {seconds / floor:.2f} |")


if __name__ == "__main__":
    main()
