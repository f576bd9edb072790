"""A small REINFORCE loop whose only generation import is gen-interface: the same loop runs on a
local backend or on a server somewhere else, by config alone.

    uv run python examples/reinforce_loop.py                           # gen-hf in this process
    uv run python examples/reinforce_loop.py --backend sglang          # SGLang servers here
    uv run gen-serve --backend hf --model DIR --port 8000 &            # or a server ...
    uv run python examples/reinforce_loop.py --base-url http://127.0.0.1:8000 --model DIR
    uv run python examples/reinforce_loop.py --deltas                  # refits send what changed

Each step samples 4 answers to each of 6 prompts, rewards an answer by the share of its tokens
with an even id (a toy task the policy can learn), scores the answers with the trainer's own
forward pass, takes a policy-gradient step and sends the new weights to the generator
(``Refitter``). It prints each step's mean reward, the mismatch between the generator's and
the trainer's logprobs of the same tokens (the number RL engineers watch for off-policy drift),
and the bytes the step's refit sent. With --deltas each tensor goes whole or as a delta against
the weights the generator holds, whichever is smaller (through buckets: a generator in this
process is otherwise handed the tensors themselves, which sends no bytes at all).
Without --model it trains the testkit's tiny random Qwen2 (built on first use).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from gen_interface import BatchedDataDict, create_generation_backend
from gen_interface.weights import Refitter
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7], [300, 12, 40], [64], [11, 13, 17, 19]]


@dataclass
class Step:
    """One step's numbers."""

    reward: float  # mean reward of the step's answers
    mismatch: float  # mean |generator logprob - trainer logprob| over the answers' tokens
    weight_version: int  # the weights the step's answers were sampled from
    sent_bytes: int = 0  # bytes the step's refit sent (whole tensors and deltas)
    whole_bytes: int = 0  # bytes of the weights that refit carried


def run(
    model: str,
    *,
    base_url: str | None = None,
    steps: int = 3,
    samples: int = 4,
    seed: int = 0,
    lr: float = 0.05,
    batch_invariant: bool = False,
    backend: str = "hf",
    temperature: float = 1.0,
    deltas: bool = False,
) -> list[Step]:
    """Train ``model`` for ``steps`` steps, generating locally (``backend``: gen-hf, or any
    backend that loads the model, e.g. ``"sglang"``) or on ``base_url``; ``deltas``: refits
    send deltas where the generator takes them."""
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    sampling = {"max_new_tokens": 16, "temperature": temperature}
    if batch_invariant:
        sampling["batch_invariant"] = True
    if base_url is None:  # a local backend reads the tokenizer's ids; a server says its own
        config = {"backend": backend, "model_name": model, "dtype": "float32"}
        if backend == "hf":
            config["hf_cfg"] = {"device": "cpu"}
        config = _with_token_ids(model, config)
    else:
        config = {"backend": "remote", "remote_cfg": {"base_url": base_url}}
    generator = create_generation_backend({**config, **sampling})
    history = []
    try:
        options = {"deltas": True, "hand_over": False} if deltas else {}
        with Refitter(generator, **options) as refitter:
            refitter.refit(policy.state_dict())  # the trainer's weights are the generator's
            for step in range(steps):
                batch = _batch(samples, seed=seed * 1000 + step)
                out = generator.generate(batch)
                rewards, mask = _rewards(out)
                trainer = _trainer_logprobs(policy, out)
                mismatch = ((out["logprobs"] - trainer.detach()).abs() * mask).sum() / mask.sum()
                advantage = rewards - rewards.mean()
                loss = -(advantage[:, None] * trainer * mask).sum() / mask.sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                refitter.refit(policy.state_dict())
                size = refitter.last_size
                history.append(
                    Step(
                        float(rewards.mean()),
                        float(mismatch),
                        int(out["weight_version"][0]),
                        size.sent_bytes if size else 0,
                        size.whole_bytes if size else 0,
                    )
                )
                print(
                    f"step {step}: reward {history[-1].reward:.4f}, logprob mismatch "
                    f"{history[-1].mismatch:.3e}, weights v{history[-1].weight_version}, refit "
                    f"sent {history[-1].sent_bytes / 2**20:.2f} of "
                    f"{history[-1].whole_bytes / 2**20:.2f} MiB"
                    + (f" ({size.deltas} of {size.tensors} tensors as deltas)" if size else "")
                )
    finally:
        generator.shutdown()
    return history


def _with_token_ids(model: str, config: dict[str, Any]) -> dict[str, Any]:
    from gen_interface import configure_generation_config
    from transformers import AutoTokenizer

    return configure_generation_config(config, AutoTokenizer.from_pretrained(model))


def _batch(samples: int, seed: int) -> BatchedDataDict[Any]:
    """Every prompt ``samples`` times, left-padded, each row with its own seed."""
    rows = [p for p in PROMPTS for _ in range(samples)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    seeds = torch.arange(len(rows), dtype=torch.int64) + seed * len(rows)
    return BatchedDataDict(input_ids=ids, attention_mask=mask, sample_seeds=seeds)


def _rewards(out: BatchedDataDict[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the share of its generated tokens with an even id; and the mask ``[B, L]`` of
    the generated positions."""
    ends = out["unpadded_sequence_lengths"]
    starts = ends - out["generation_lengths"]
    positions = torch.arange(out["output_ids"].shape[1])
    mask = ((positions >= starts[:, None]) & (positions < ends[:, None])).float()
    even = (out["output_ids"] % 2 == 0).float() * mask
    return even.sum(1) / mask.sum(1).clamp(min=1), mask


def _trainer_logprobs(policy: Any, out: BatchedDataDict[Any]) -> torch.Tensor:
    """The trainer's logprob of every token at its position (``[B, L]``, the output layout)."""
    ids = out["output_ids"]
    attention = (torch.arange(ids.shape[1]) < out["unpadded_sequence_lengths"][:, None]).long()
    logits = policy(input_ids=ids, attention_mask=attention).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
    return torch.cat([torch.zeros(ids.shape[0], 1), logprobs], dim=1)


def main(argv: list[str] | None = None) -> list[Step]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the testkit's tiny Qwen2)")
    parser.add_argument("--base-url", help="a gen-serve server (default: a backend here)")
    parser.add_argument("--backend", default="hf", help="the backend here: hf, vllm, sglang")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deltas", action="store_true", help="refits send what changed")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="generate batch-invariant (a server's backend must have been started so)",
    )
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from gen_testkit.models import build_tiny_model

        model = str(build_tiny_model("tiny-qwen2").path)
    return run(
        model,
        base_url=args.base_url,
        backend=args.backend,
        steps=args.steps,
        seed=args.seed,
        batch_invariant=args.batch_invariant,
        deltas=args.deltas,
    )


if __name__ == "__main__":
    main()
