"""The seed document's usage example, with this project's module names.

    uv run python examples/vllm_generation.py                # a tiny random model, on CPU
    uv run python examples/vllm_generation.py --model DIR    # any local Hugging Face model

Without --model it builds the testkit's tiny random Qwen2 model, so it runs anywhere; the text it
prints is then random tokens.
"""

from __future__ import annotations

import argparse

import torch
from gen_interface import BatchedDataDict, configure_generation_config
from gen_vllm import RayVirtualCluster, VllmConfig, VllmGeneration
from transformers import AutoTokenizer


def get_tokenizer(model_name: str):
    return AutoTokenizer.from_pretrained(model_name)


def main(argv: list[str] | None = None) -> BatchedDataDict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or hub name (default: a tiny model)")
    parser.add_argument("--replicas", type=int, default=1, help="data-parallel vLLM engines")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--cpu", action="store_true", help="run on CPUs even where Ray sees GPUs")
    args = parser.parse_args(argv)
    if args.model is None:
        from gen_testkit.models import build_tiny_model

        args.model = str(build_tiny_model("tiny-qwen2").path)

    # Set up the configuration
    config = VllmConfig(
        model_name=args.model,
        max_new_tokens=32,
        temperature=0.7,
        top_p=1,
        top_k=None,
        backend="vllm",
        vllm_cfg={
            "tensor_parallel_size": 1,
            "gpu_memory_utilization": 0.8,
            "max_model_len": args.max_model_len,
        },
    )
    # Configure config with tokenizer
    tokenizer = get_tokenizer(config["model_name"])
    config = configure_generation_config(config, tokenizer)
    # Initialize the cluster and generation backend
    cluster = RayVirtualCluster(
        bundle_ct_per_node_list=[args.replicas], use_gpus=False if args.cpu else None
    )
    generator = VllmGeneration(cluster, config)
    try:
        # Prepare input data: token ids only; the tokenizer stays outside the backend
        prompts = ["The policy samples", "Reinforcement learning from feedback"]
        encoded = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
        input_data = BatchedDataDict(
            input_ids=encoded["input_ids"].to(torch.int64),
            attention_mask=encoded["attention_mask"],
        )
        # Generate text
        generator.prepare_for_generation()
        output = generator.generate(input_data, greedy=False)
        generator.finish_generation()
    finally:
        generator.shutdown()
        cluster.shutdown()
    for i, prompt in enumerate(prompts):
        end = int(output["unpadded_sequence_lengths"][i])
        start = end - int(output["generation_lengths"][i])
        text = tokenizer.decode(output["output_ids"][i, start:end])
        print(f"{prompt!r} -> {text!r} ({end - start} tokens)")
    return output


if __name__ == "__main__":
    main()
