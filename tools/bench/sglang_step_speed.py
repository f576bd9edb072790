"""gen-sglang against SGLang's own ``/generate`` where a decode step is fast: what the layer adds.

    .venv/bin/python tools/bench/sglang_step_speed.py [--model bench-step] [--batches 1,64]
        [--pairs 5] [--new 16,128] [--prompt 8,96] [--timeout 300] [--json FILE]
        [--plain-threads sglang|ours] [--chunk-tokens N]

On a testkit model (``bench-step``, the default: the Llama of hidden 128 whose decode step over
64 rows takes a GPU's order of time on two cores; ``bench-50m`` for the older, slow-step model),
two SGLang servers from the same SGLang environment, side by side, both on 127.0.0.1 and a free
port:

- ``ours``: ``SglangGeneration.generate`` (the backend in this process, driving the server it
  started: one streamed ``/generate`` for the call's rows, each row's tokens in chunks of
  ``sglang_cfg.chunk_tokens`` (``--chunk-tokens``; 16 by default), every sampled row chosen
  inside the server by ``RowSampler``, gen-sglang's logit processor, from a generator seeded
  with the row's seed, each token's logprob and weight version reported);
- ``sglang``: a plain server started with the very arguments and environment gen-sglang starts
  its own with (``gen_sglang.server_args``), less ``--enable-custom-logit-processor`` and, by
  default, less gen-sglang's thread count (``sglang_cfg.cpu_threads``: every core but one), so
  the forward pass runs on every core as SGLang sets it (``--plain-threads ours`` gives it
  gen-sglang's count, which isolates what the layer adds from the thread count's effect),
  driven as SGLang's RL clients drive it (slime, AReaL): one non-streamed ``/generate`` whose
  ``input_ids`` is the batch's list and whose ``sampling_params`` is a list of each row's
  settings (SGLang's own sampler, temperature 1), ``return_logprob`` on (one logprob per token,
  as ours reports). SGLang's ``sampling_seed`` is not sent: it honours it only in its
  deterministic-inference mode, a GPU mode; ours draws from each row's seed.

Workload, the same for both sides (fixed seed): ``batch`` prompts of random ids (``--prompt``
lengths), each with its own ``max_new_tokens`` drawn uniformly from ``--new`` and its own seed,
temperature 1, no stop token and EOS ignored (ours: ``stop_token_ids: []`` on a server that
names no eos; SGLang: ``ignore_eos``), so every row runs to its length. Generated tokens are
counted on both sides and must be equal (the script stops if not; each pair prints both). Both
servers' prefix caches are flushed before every run. Each side answers one batch first
(untimed); then ``--pairs`` interleaved pairs (SGLang, then ours) per batch size: the machine's
drift falls on both sides alike. Reported per batch: the medians of generated tokens per wall
second, the median of the pairs' ratios (ours / SGLang) with their spread (min-max), and at
batch 1 the row's latency (seconds) each side. Every run is bounded: ``--timeout`` seconds, one
batch of requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import torch
from gen_interface import BatchedDataDict, create_generation_backend
from gen_testkit.models import build_tiny_model
from quiet import wait_until_quiet
from workloads import Work, left_padded, random_requests, sampled_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-step", help="testkit preset")
    parser.add_argument("--batches", "--batch", default="1,64", help="comma-separated sizes")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs per figure")
    parser.add_argument("--new", default="16,128", help="smallest,largest max_new_tokens")
    parser.add_argument("--prompt", default="8,96", help="shortest,longest prompt")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        help="gen-sglang's sglang_cfg.chunk_tokens (default: its own, 16): tokens per chunk of "
        "a row's stream when the call does not stream tokens",
    )
    parser.add_argument(
        "--plain-threads",
        choices=("sglang", "ours"),
        default="sglang",
        help="the plain server's forward-pass threads: SGLang's default (every core) or "
        "gen-sglang's (sglang_cfg.cpu_threads: every core but one)",
    )
    return parser.parse_args()


@dataclass
class Figure:
    """One (model, batch): every pair's seconds, and the tokens each run generated."""

    model: str
    batch: int
    tokens: int = 0
    sglang_seconds: list[float] = field(default_factory=list)
    ours_seconds: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """Per pair: ours tokens/s over SGLang's (SGLang's seconds / ours)."""
        return [s / o for s, o in zip(self.sglang_seconds, self.ours_seconds)]

    def row(self) -> str:
        theirs = statistics.median(self.tokens / s for s in self.sglang_seconds)
        ours = statistics.median(self.tokens / s for s in self.ours_seconds)
        ratios = self.ratios()
        latency = "-"
        if self.batch == 1:
            latency = (
                f"{statistics.median(self.sglang_seconds):.3f} / "
                f"{statistics.median(self.ours_seconds):.3f} s"
            )
        return (
            f"| {self.model} | {self.batch} | {self.tokens} | {theirs:.0f} | {ours:.0f} "
            f"| {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {latency} |"
        )


def workload(args: argparse.Namespace, batch: int, vocab: int) -> Work:
    return random_requests(batch, vocab, args.new, args.prompt, args.seed)


class Ours:
    """``SglangGeneration`` with one server, sampled rows, raw logprobs."""

    def __init__(self, model: str, high: int, chunk_tokens: int | None = None):
        extra = {"sglang_cfg": {"chunk_tokens": chunk_tokens}} if chunk_tokens else {}
        self.backend: Any = create_generation_backend(
            sampled_config("sglang", model, high, **extra)
        )

    def run(self, work: Work) -> tuple[float, int]:
        batch = _batch(work)
        self.backend.invalidate_kv_cache()
        start = time.perf_counter()
        out = self.backend.generate(batch)
        seconds = time.perf_counter() - start
        return seconds, int(out["generation_lengths"].sum())


class Plain:
    """A plain SGLang server: gen-sglang's arguments and environment, no logit processor, and
    the forward pass's threads as SGLang sets them (``threads="sglang"``: every core) or as
    gen-sglang does (``"ours"``)."""

    def __init__(self, ours: Ours, timeout_s: float, threads: str = "sglang"):
        from gen_sglang.environment import managed_python
        from gen_sglang.server import SglangServer
        from gen_sglang.server_args import server_args, server_env

        backend = ours.backend
        args = server_args(
            backend.config,
            "float32",
            cpu=True,
            tokenizer=backend.has_tokenizer,
            kv_bytes=backend._kv_bytes_per_token,
        )
        args.remove("--enable-custom-logit-processor")
        env = server_env(backend.config["sglang_cfg"], cpu=True)
        if threads == "sglang":
            del env["OMP_NUM_THREADS"]
        model = str(backend.config["model_name"])
        self.server = SglangServer(managed_python(), model, args, env, name="plain SGLang")
        self.server.wait_ready(600)
        self.client = httpx.Client(base_url=self.server.url, timeout=timeout_s)

    def run(self, work: Work) -> tuple[float, int]:
        body = {
            "input_ids": [prompt for prompt, _, _ in work],
            "sampling_params": [
                {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
                for _, new, _ in work
            ],
            "return_logprob": True,
        }
        self.client.post("/flush_cache").raise_for_status()
        start = time.perf_counter()
        response = self.client.post("/generate", json=body)
        seconds = time.perf_counter() - start
        response.raise_for_status()
        answers = response.json()
        tokens = sum(len(a["output_ids"]) for a in answers)
        logprobs = sum(len(a["meta_info"]["output_token_logprobs"]) for a in answers)
        if logprobs != tokens:
            raise RuntimeError("SGLang returned a logprob count unlike its token count")
        return seconds, tokens

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def _batch(work: Work) -> BatchedDataDict[Any]:
    batch = left_padded([prompt for prompt, _, _ in work])
    batch["max_new_tokens"] = torch.tensor([new for _, new, _ in work])
    batch["sample_seeds"] = torch.tensor([seed for _, _, seed in work])
    return batch


def measure(args: argparse.Namespace) -> list[Figure]:
    model = build_tiny_model(args.model)
    high = int(args.new.split(",")[1])
    print(f"{args.model}: starting gen-sglang and a plain SGLang server", flush=True)
    ours = Ours(str(model.path), high, args.chunk_tokens)
    figures = []
    try:
        plain = Plain(ours, args.timeout, args.plain_threads)
        try:
            for size in (int(b) for b in args.batches.split(",")):
                work = workload(args, size, model.vocab_size)
                figure = Figure(args.model, size)
                plain.run(work)  # warm-up, each side
                ours.run(work)
                for pair in range(args.pairs):
                    wait_until_quiet()  # a server may keep polling after a run
                    theirs_s, theirs_n = plain.run(work)
                    wait_until_quiet()
                    ours_s, ours_n = ours.run(work)
                    print(
                        f"  batch {size}, pair {pair + 1}: SGLang {theirs_n} tokens in "
                        f"{theirs_s:.3f} s ({theirs_n / theirs_s:.0f} tok/s), ours {ours_n} "
                        f"tokens in {ours_s:.3f} s ({ours_n / ours_s:.0f} tok/s): "
                        f"{theirs_s / ours_s:.3f}x",
                        flush=True,
                    )
                    if theirs_n != ours_n or ours_n != sum(n for _, n, _ in work):
                        raise RuntimeError(f"unequal work: SGLang {theirs_n}, ours {ours_n}")
                    figure.tokens = ours_n
                    figure.sglang_seconds.append(theirs_s)
                    figure.ours_seconds.append(ours_s)
                print(figure.row(), flush=True)
                figures.append(figure)
        finally:
            plain.close()
    finally:
        ours.backend.shutdown()
    return figures


def main() -> list[Figure]:
    args = parse_args()
    figures = measure(args)
    print()
    print(
        "| model | batch | tokens | SGLang tok/s | ours tok/s | ratio (spread) "
        "| batch-1 latency SGLang / ours |"
    )
    print("|---|---|---|---|---|---|---|")
    for figure in figures:
        print(figure.row())
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(f) for f in figures], out, indent=1)
    return figures


if __name__ == "__main__":
    main()
