"""``lm_head_fp32`` on both backends: how far bfloat16 logprobs are from a float32 reference,
with the head in bfloat16 and in float32, side by side in one run.

    uv run python tools/bench/fp32_head.py [--model tiny-qwen2] [--rows 16] [--new 32]

The reference is gen-hf in float32: it generates ``--rows`` greedy rows of ``--new`` tokens
(random prompts, fixed seed) and scores them. Every candidate (gen-hf, gen-vllm with one CPU
engine; each in bfloat16, head in bfloat16 then float32) teacher-forces the same sequences
through ``score``. Reported: the mean multiplicative error ``mean |p / p_ref - 1|`` and the
mean absolute logprob error over the generated positions, and the ratio of each backend's error
with the float32 head to the one without. Bounded: one scoring call per candidate.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

import torch
from gen_interface import BatchedDataDict, configure_generation_config
from gen_testkit.models import build_tiny_model
from transformers import AutoTokenizer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen2", help="a testkit preset")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--backends", default="hf,vllm")
    return parser.parse_args()


def build(backend: str, path: str, dtype: str, head: bool) -> Any:
    config = configure_generation_config(
        {
            "backend": backend,
            "model_name": path,
            "dtype": dtype,
            "lm_head_fp32": head,
            "max_new_tokens": 32,
            "stop_token_ids": [],
            **({"hf_cfg": {"device": "cpu"}} if backend == "hf" else {}),
            **({"vllm_cfg": {"cpu_kv_cache_gib": 0.5}} if backend == "vllm" else {}),
        },
        AutoTokenizer.from_pretrained(path),
    )
    if backend == "hf":
        from gen_hf import HfGeneration

        return HfGeneration(config), None
    from gen_vllm import RayVirtualCluster, VllmGeneration

    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    return VllmGeneration(cluster, config), cluster


def main() -> dict[str, dict[bool, float]]:
    args = parse_args()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    model = build_tiny_model(args.model)
    path = str(model.path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(8)] for _ in range(args.rows)]
    reference, _ = build("hf", path, "float32", False)
    batch = BatchedDataDict(
        input_ids=torch.tensor(prompts), input_lengths=torch.full((args.rows,), 8)
    )
    out = reference.with_sampling(max_new_tokens=args.new).generate(batch, greedy=True)
    sequences = BatchedDataDict(
        input_ids=out["output_ids"],
        prompt_lengths=torch.full((args.rows,), 8),
        unpadded_sequence_lengths=out["unpadded_sequence_lengths"],
    )
    truth = reference.score(sequences)
    reference.shutdown()
    scored = truth != 0
    errors: dict[str, dict[bool, float]] = {}
    print("| backend | head | mean abs logprob error | mean multiplicative error |")
    print("|---|---|---|---|")
    for name in args.backends.split(","):
        errors[name] = {}
        for head in (False, True):
            backend, cluster = build(name, path, "bfloat16", head)
            try:
                got = backend.score(sequences)
            finally:
                backend.shutdown()
                if cluster is not None:
                    cluster.shutdown()
            diff = (got[scored] - truth[scored]).abs()
            ratio = (got[scored] - truth[scored]).exp().sub(1).abs().mean()
            errors[name][head] = float(ratio)
            print(
                f"| {name} | {'float32' if head else 'bfloat16'} | {float(diff.mean()):.3e} | "
                f"{float(ratio):.3e} |",
                flush=True,
            )
    print()
    for name, by_head in errors.items():
        print(f"{name}: float32 head / bfloat16 head = {by_head[True] / by_head[False]:.2f}")
    return errors


if __name__ == "__main__":
    main()
