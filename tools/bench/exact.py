"""The cost of ``batch_invariant: true`` on gen-hf: generation and the trainer's forward.

In one process, on the same random-weight model and random prompts:

- generation: ``HfGeneration`` with and without ``batch_invariant``, greedy, no stop token,
  exactly ``--new-tokens`` tokens per row (target: the invariant one at most 3x slower);
- the trainer's forward: ``gen_hf.exact.sequence_logprobs`` against the model's own
  forward plus ``log_softmax`` on the generated sequences (no gradients).

Runs alternate so that load from other processes falls on all alike. Reported: seconds of the
fastest and the median run of each, the ratios, and whether the invariant rollout's logprobs
equal the trainer's exact ones bitwise (they must).

Usage::

    uv run python tools/bench/exact.py                 # bench-50m, batch 32, 32 + 64 tokens
    uv run python tools/bench/exact.py --dtype bfloat16 --repeats 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from gen_hf import HfGeneration
from gen_hf.exact import sequence_logprobs
from gen_interface import BatchedDataDict
from gen_testkit.models import PRESETS, build_tiny_model
from transformers import AutoModelForCausalLM


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-50m", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=32, help="rows per call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    return parser.parse_args()


def backend_for(path: str, args: argparse.Namespace, *, invariant: bool) -> HfGeneration:
    return HfGeneration(
        {
            "backend": "hf",
            "model_name": path,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "stop_token_ids": [],
            "stop_strings": None,
            "pad_token_id": 0,
            "logprobs_mode": "raw",
            "seed": 0,
            "dtype": args.dtype,
            "colocated": {"enabled": False},
            "batch_invariant": invariant,
            "hf_cfg": {"device": "cpu", "max_batch_size": args.batch},
        }
    )


def main() -> dict[str, Any]:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = build_tiny_model(args.preset)
    path = str(model.path)
    plain, invariant = (backend_for(path, args, invariant=flag) for flag in (False, True))
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(
        3, model.vocab_size, (args.batch, args.prompt_len), generator=generator
    )
    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids)
    )
    rollout = invariant.generate(batch, greedy=True)
    sequences = rollout["output_ids"]
    mask = torch.ones_like(sequences)

    def own_forward() -> torch.Tensor:
        with torch.inference_mode():
            logits = trainer(input_ids=sequences, attention_mask=mask).logits
            logprobs = logits[:, :-1].float().log_softmax(dim=-1)
            return logprobs.gather(-1, sequences[:, 1:, None])[..., 0]

    def exact_forward() -> torch.Tensor:
        with torch.inference_mode():
            return sequence_logprobs(trainer, sequences, mask)

    runs: dict[str, Callable[[], Any]] = {
        "generate": lambda: plain.generate(batch, greedy=True),
        "generate, batch_invariant": lambda: invariant.generate(batch, greedy=True),
        "trainer forward": own_forward,
        "trainer forward, exact": exact_forward,
    }
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    exact = exact_forward()[:, args.prompt_len :]
    equal = torch.equal(rollout["logprobs"][:, args.prompt_len :], exact)
    fastest = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    result: dict[str, Any] = {
        "preset": args.preset,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "fastest_s": fastest,
        "median_s": median,
        "generate_ratio": fastest["generate, batch_invariant"] / fastest["generate"],
        "forward_ratio": fastest["trainer forward, exact"] / fastest["trainer forward"],
        "rollout_equals_exact_forward": equal,
    }
    print(
        f"{args.preset}, cpu, {args.dtype}, {torch.get_num_threads()} threads: batch "
        f"{args.batch}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"{args.repeats} runs each"
    )
    print("                               fastest (s)  median (s)")
    for name in runs:
        print(f"  {name:28s}{fastest[name]:11.3f}{median[name]:12.3f}")
    print(
        f"  batch_invariant / plain: generate {result['generate_ratio']:.2f}x (target <= 3), "
        f"trainer forward {result['forward_ratio']:.2f}x"
    )
    print(f"  rollout logprobs equal the exact forward bitwise: {equal}")
    if args.json:
        print(json.dumps(result))
    for backend in (plain, invariant):
        backend.shutdown()
    return result


if __name__ == "__main__":
    main()
