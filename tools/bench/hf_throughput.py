"""Throughput of ``HfGeneration`` against transformers' own ``generate`` on the same inputs.

Both decode greedily, with no stop token, exactly ``--new-tokens`` tokens per row, from the same
random prompts on the same random-weight model, in one process. Runs alternate between the two
so that load from other processes falls on both alike. Reported: tokens per second of each, from
the fastest run (the one least disturbed by other load) and from the median run, and the ratio
``HfGeneration / transformers`` of each (target: at least 0.9).

Usage::

    uv run python tools/bench/hf_throughput.py            # bench-50m, batch 32, 32 + 64 tokens
    uv run python tools/bench/hf_throughput.py --repeats 5 --json
    uv run python tools/bench/hf_throughput.py --threads 1   # steadier on a busy machine
    uv run python tools/bench/hf_throughput.py --batch 1,4,16,32 --plot hf.png  # a curve

A list of ``--batch`` sizes measures each in turn (the same report per size); ``--plot FILE``
draws tokens per second of both against the batch size (``plots.batch_throughput``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from gen_hf import HfGeneration, HfSpecificArgs
from gen_interface import BatchedDataDict
from gen_testkit.models import PRESETS, build_tiny_model
from transformers import AutoModelForCausalLM
from transformers import GenerationConfig as HfGenerationConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-50m", choices=sorted(PRESETS))
    parser.add_argument(
        "--batch", default="32", help="rows per call; a comma-separated list measures each"
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument(
        "--attn", default=None, choices=["eager", "sdpa"], help="attention (default: gen-hf's)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each first")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    parser.add_argument("--plot", metavar="FILE", help="draw tokens/s against batch size here")
    return parser.parse_args()


def timed(run: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds one call of ``run`` takes, and what it returned."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def main() -> list[dict[str, Any]]:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    model = build_tiny_model(args.preset)
    hf_cfg: HfSpecificArgs = {"device": args.device, "max_batch_size": max(batches)}
    if args.attn:
        hf_cfg["attn_implementation"] = args.attn
    backend = HfGeneration(
        {
            "backend": "hf",
            "model_name": str(model.path),
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "stop_token_ids": [],
            "stop_strings": None,
            "pad_token_id": model.pad_token_id,
            "logprobs_mode": "raw",
            "seed": 0,
            "dtype": args.dtype,
            "colocated": {"enabled": False},
            "hf_cfg": hf_cfg,
        }
    )
    attn = backend.config["hf_cfg"]["attn_implementation"]
    reference = (
        AutoModelForCausalLM.from_pretrained(
            str(model.path), dtype=_DTYPES[args.dtype], attn_implementation=attn
        )
        .eval()
        .to(backend.device)
    )
    # No eos (generate would fall back to the checkpoint's) and no minimum-length processor:
    # transformers runs exactly new_tokens steps on every row, like HfGeneration without stops.
    reference.generation_config.eos_token_id = None
    reference_config = HfGenerationConfig(
        do_sample=False,
        max_new_tokens=args.new_tokens,
        eos_token_id=None,
        pad_token_id=model.pad_token_id,
    )
    results = [
        measure(args, batch, backend, reference, reference_config, model.vocab_size)
        for batch in batches
    ]
    backend.shutdown()
    if args.plot:
        import plots

        points = [
            {"generator": name, "batch": r["batch"], "tokens_s": r[f"{key}_tok_s"]}
            | {"median_tokens_s": r[f"{key}_median_tok_s"]}
            for r in results
            for name, key in (
                ("HfGeneration.generate", "hf_generation"),
                ("transformers generate", "transformers"),
            )
        ]
        title = (
            f"{args.preset}, {results[0]['device']}, {args.dtype}, {args.prompt_len}-token "
            f"prompts, {args.new_tokens} new tokens, {results[0]['threads']} threads"
        )
        print(f"wrote {plots.batch_throughput(points, args.plot, title)}")
    return results


def measure(
    args: argparse.Namespace,
    batch_size: int,
    backend: HfGeneration,
    reference: Any,
    reference_config: HfGenerationConfig,
    vocab_size: int,
) -> dict[str, Any]:
    """Both generators on ``batch_size`` rows, alternating; prints and returns the result."""
    device = backend.device
    attn = backend.config["hf_cfg"]["attn_implementation"]
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(3, vocab_size, (batch_size, args.prompt_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=input_ids, attention_mask=attention_mask
    )
    reference_inputs = {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
    }

    def ours() -> torch.Tensor:
        return backend.generate(batch, greedy=True)["output_ids"][:, args.prompt_len :]

    def theirs() -> torch.Tensor:
        with torch.inference_mode():
            out = reference.generate(**reference_inputs, generation_config=reference_config)
        return out[:, args.prompt_len :].cpu()

    for _ in range(args.warmup):
        ours()
        theirs()
    our_times, their_times = [], []
    for _ in range(args.repeats):
        seconds, our_tokens = timed(ours, device)
        our_times.append(seconds)
        seconds, their_tokens = timed(theirs, device)
        their_times.append(seconds)
    tokens = batch_size * args.new_tokens
    assert our_tokens.shape == their_tokens.shape == (batch_size, args.new_tokens), (
        f"token counts differ: {tuple(our_tokens.shape)} vs {tuple(their_tokens.shape)}"
    )
    result = {
        "preset": args.preset,
        "parameters": sum(p.numel() for p in reference.parameters()),
        "device": str(device),
        "dtype": args.dtype,
        "attn_implementation": attn,
        "batch": batch_size,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "hf_generation_tok_s": tokens / min(our_times),
        "transformers_tok_s": tokens / min(their_times),
        "hf_generation_median_tok_s": tokens / statistics.median(our_times),
        "transformers_median_tok_s": tokens / statistics.median(their_times),
        "hf_generation_runs_s": [round(t, 3) for t in our_times],
        "transformers_runs_s": [round(t, 3) for t in their_times],
        "same_tokens": bool(torch.equal(our_tokens, their_tokens)),
    }
    result["ratio"] = result["hf_generation_tok_s"] / result["transformers_tok_s"]
    result["median_ratio"] = (
        result["hf_generation_median_tok_s"] / result["transformers_median_tok_s"]
    )
    print(
        f"{args.preset} ({result['parameters'] / 1e6:.1f}M parameters), {device}, {args.dtype}, "
        f"{attn}, {torch.get_num_threads()} threads: batch {batch_size}, "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, {args.repeats} runs each"
    )
    print("                          tokens/s (fastest)  tokens/s (median)  runs (s)")
    for name, key, runs in (
        ("HfGeneration.generate", "hf_generation", result["hf_generation_runs_s"]),
        ("transformers generate", "transformers", result["transformers_runs_s"]),
    ):
        print(
            f"  {name:24s}{result[key + '_tok_s']:14.1f}{result[key + '_median_tok_s']:19.1f}"
            f"  {runs}"
        )
    print(f"  ratio                   {result['ratio']:14.3f}{result['median_ratio']:19.3f}")
    print(f"  same greedy tokens: {result['same_tokens']} (target ratio >= 0.9)")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
