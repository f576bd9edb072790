"""On-policy distillation: the student generates, a teacher scores the student's rollouts with its
top-k logprobs, and a few steps of forward KL on those k tokens move the student towards the
teacher; the student's new weights go back to its generator each step.

    uv run python examples/distillation.py                       # two tiny random models, on CPU
    uv run python examples/distillation.py --student DIR --teacher DIR2 --backend vllm

Both generators are built by config through gen-interface alone (``create_generation_backend``):
``--backend hf`` (default), ``vllm`` or ``remote`` (``--student-url`` / ``--teacher-url`` name
gen-serve servers). The teacher only scores (``score_top_logprobs``); the student's trainer is a
plain transformers model. Each step prints the mean top-k forward KL of the step's rollouts,
``sum_k p_teacher(k) * (log p_teacher(k) - log p_student(k))`` over the teacher's k likeliest
tokens at every generated position, measured before the step's update. Without --student and
--teacher it distils the testkit's tiny random Llama into its tiny random Qwen2 (same
vocabulary).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from gen_interface import BatchedDataDict, create_generation_backend
from gen_interface.weights import Refitter
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7], [300, 12, 40], [64], [11, 13, 17, 19]]


def run(
    student: str,
    teacher: str,
    *,
    backend: str = "hf",
    urls: tuple[str | None, str | None] = (None, None),
    steps: int = 4,
    top_k: int = 8,
    samples: int = 4,
    lr: float = 1e-2,
    seed: int = 0,
) -> list[float]:
    """Distil ``teacher`` into ``student`` for ``steps`` steps; returns each step's KL."""
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    rollouts = create_generation_backend(
        _config(backend, student, urls[0], max_new_tokens=16, temperature=1.0, seed=seed)
    )
    scorer = create_generation_backend(_config(backend, teacher, urls[1]))
    kls = []
    try:
        with Refitter(rollouts) as refitter:
            refitter.refit(policy.state_dict())
            for step in range(steps):
                out = rollouts.generate(_batch(samples))
                sequences = BatchedDataDict(
                    input_ids=out["output_ids"],
                    prompt_lengths=out["unpadded_sequence_lengths"] - out["generation_lengths"],
                    unpadded_sequence_lengths=out["unpadded_sequence_lengths"],
                )
                target = scorer.score_top_logprobs(sequences, top_k)
                kl = _top_k_forward_kl(policy, out, target)
                optimizer.zero_grad()
                kl.backward()
                optimizer.step()
                refitter.refit(policy.state_dict())
                kls.append(float(kl.detach()))
                print(f"step {step}: top-{top_k} forward KL {kls[-1]:.4f}", flush=True)
    finally:
        rollouts.shutdown()
        scorer.shutdown()
    return kls


def _config(backend: str, model: str, url: str | None, **sampling: Any) -> dict[str, Any]:
    if backend == "remote":
        return {"backend": "remote", "remote_cfg": {"base_url": url}, **sampling}
    from gen_interface import configure_generation_config
    from transformers import AutoTokenizer

    own = {"hf_cfg": {"device": "cpu"}} if backend == "hf" else {}
    config = {"backend": backend, "model_name": model, "dtype": "float32", **own, **sampling}
    return configure_generation_config(config, AutoTokenizer.from_pretrained(model))


def _batch(samples: int) -> BatchedDataDict[Any]:
    rows = [p for p in PROMPTS for _ in range(samples)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return BatchedDataDict(input_ids=ids, attention_mask=mask)


def _top_k_forward_kl(
    policy: Any, out: BatchedDataDict[Any], target: BatchedDataDict[Any]
) -> torch.Tensor:
    """Mean over generated positions of the forward KL restricted to the teacher's top k.

    ``out``: the rollouts (``output_ids`` ``[B, L]``); ``target``: their ``score_top_logprobs``,
    ``topk_ids`` / ``topk_logprobs`` ``[B, L, k]`` at position ``t`` for the token at ``t`` given
    the tokens before it (-1 and 0.0 elsewhere).
    """
    ids = out["output_ids"]
    top_ids, top_logprobs = target["topk_ids"], target["topk_logprobs"]
    scored = top_ids[:, :, 0] >= 0  # [B, L]: generated positions
    attention = (torch.arange(ids.shape[1]) < out["unpadded_sequence_lengths"][:, None]).long()
    logits = policy(input_ids=ids, attention_mask=attention).logits.float()
    student = torch.log_softmax(logits, dim=-1)  # [B, L, V]: position t predicts token t + 1
    predicted = torch.cat([torch.zeros_like(student[:, :1]), student[:, :-1]], dim=1)
    chosen = predicted.gather(2, top_ids.clamp(min=0))  # [B, L, k]
    teacher = top_logprobs.exp()
    per_position = (teacher * (top_logprobs - chosen)).sum(-1)  # [B, L]
    return per_position[scored].mean()


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", help="student model directory (default: tiny Qwen2)")
    parser.add_argument("--teacher", help="teacher model directory (default: tiny Llama)")
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm", "remote"])
    parser.add_argument("--student-url", help="the student's gen-serve server (--backend remote)")
    parser.add_argument("--teacher-url", help="the teacher's gen-serve server (--backend remote)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    student, teacher = args.student, args.teacher
    if student is None or teacher is None:
        from gen_testkit.models import build_tiny_model

        student = student or str(build_tiny_model("tiny-qwen2").path)
        teacher = teacher or str(build_tiny_model("tiny-llama").path)
    return run(
        student,
        teacher,
        backend=args.backend,
        urls=(args.student_url, args.teacher_url),
        steps=args.steps,
    )


if __name__ == "__main__":
    main()
