"""Delta refits against whole ones, after a realistic optimizer step.

    uv run python tools/bench/delta_refit.py [--model bench-160m] [--reps 5] \
        [--lrs 1e-6,1e-5] [--paths collective,remote]

The trainer holds float32 master weights of a testkit model (bench-160m: 160M parameters) in
transformers, takes ``--warmup-steps`` AdamW steps (lr ``--warmup-lr``) of next-token loss on
random token batches, then, separately from that same state, one more step at each of ``--lrs``.
The generator serves the model in bfloat16; the trainer sends its weights cast to bfloat16.
For each learning rate it reports the share of bfloat16 values the step changed and, per path,
the bytes on the wire and the wall time of:

- ``whole``: a whole refit into a backend as it is by default (no copy kept, no deltas), the
  figure a trainer sees today;
- ``delta``: a refit with deltas into a backend that keeps the last committed weights
  (``vllm_cfg.weight_deltas``), from the previous weights, which it holds;
- ``whole, copy kept``: a whole refit into that same backend (what deltas cost when a refit
  falls back to whole: the copy is written too, and the engine loaded from it at the commit).

Paths: ``collective``: ``WeightBroadcaster`` (gloo over loopback) from this process to gen-vllm
workers (one replica, a Ray actor: another process); ``shm``: ``Refitter`` through shared memory
into the same engines (``in place``: weights already in shared memory, ``share_tensors``);
``remote``: the ``remote`` backend against two ``gen-serve --backend vllm`` servers (processes
of their own), ``WeightBroadcaster`` through their weight routes. Every measurement is repeated
``--reps`` times, the paths interleaved within a repetition (load from elsewhere falls on all
alike); reported: median, min-max. Between repetitions the backend is put back on the previous
weights (untimed), so every delta is one optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch
from gen_interface import configure_generation_config, create_generation_backend
from gen_interface.weights import Refitter, WeightBroadcaster, share_tensors
from gen_testkit.models import build_tiny_model
from gen_testkit.servers import ServerProcess, free_port, gen_serve_command
from weight_changes import changed_share

MIB = 2**20
TOKENIZER = type("Ids", (), {"pad_token_id": 0, "eos_token_id": 2})()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-160m", help="testkit preset")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every path")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="learning rates of the measured step")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--warmup-lr", type=float, default=1e-5)
    parser.add_argument("--batch", default="2x64", help="rows x tokens of each training batch")
    parser.add_argument("--paths", default="collective,shm,remote")
    parser.add_argument("--json", help="write the rows here")
    return parser.parse_args()


# ---- the trainer ----------------------------------------------------------------------------


def train(args: argparse.Namespace, path: str) -> tuple[dict[str, torch.Tensor], dict[float, Any]]:
    """The bfloat16 weights after the warm-up, and per measured lr the weights one step later
    with the share of bfloat16 values that step changed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows, tokens = (int(x) for x in args.batch.split("x"))
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.01)

    def step(lr: float, seed: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (rows, tokens), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    started = time.perf_counter()
    for i in range(args.warmup_steps):
        step(args.warmup_lr, i)
    print(
        f"{args.warmup_steps} AdamW steps at lr {args.warmup_lr:g} in "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    before = _bf16(model)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = _clone(optimizer.state_dict())
    after: dict[float, Any] = {}
    for lr in (float(x) for x in args.lrs.split(",")):
        step(lr, 1000)
        new = _bf16(model)
        share = changed_share(before, new)
        after[lr] = (new, share)
        print(f"lr {lr:g}: {share:.2%} of the bfloat16 values changed", flush=True)
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(_clone(saved_optimizer))
    return before, after


def _bf16(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


# ---- the backends ---------------------------------------------------------------------------


def vllm_backend(path: str, deltas: bool) -> tuple[Any, Any]:
    """One replica on a one-CPU bundle of its own, so that two fit on a 2-CPU machine (a cluster
    left to its default takes every free CPU): ``(backend, cluster)``, both to shut down."""
    from gen_vllm import RayVirtualCluster, VllmGeneration

    config = {
        "backend": "vllm",
        "model_name": path,
        "max_new_tokens": 4,
        "dtype": "bfloat16",
        "stop_token_ids": [],
        "vllm_cfg": {"cpu_kv_cache_gib": 0.25, "weight_deltas": deltas},
    }
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1, name=f"delta-{deltas}")
    try:
        backend = VllmGeneration(cluster, configure_generation_config(config, TOKENIZER))
    except BaseException:
        cluster.shutdown()
        raise
    return backend, cluster


def gen_serve(path: str, deltas: bool) -> ServerProcess:
    config = Path(tempfile.mkdtemp(prefix="delta-bench-")) / "config.json"
    config.write_text(json.dumps({"vllm_cfg": {"cpu_kv_cache_gib": 0.25, "weight_deltas": deltas}}))
    port = free_port()
    extra = ["--config", str(config), "--dtype", "bfloat16"]
    server = ServerProcess(
        gen_serve_command("vllm", path, port, extra=extra), port, name=f"gen-serve-{deltas}"
    )
    server.wait_ready(900)
    return server


def remote(url: str) -> Any:
    return create_generation_backend({"backend": "remote", "remote_cfg": {"base_url": url}})


# ---- measuring ------------------------------------------------------------------------------


class Timed:
    """Seconds and bytes of every repetition of one path."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.sent: list[int] = []
        self.whole: list[int] = []
        self.deltas: list[float] = []
        #: the backend's own time per refit phase (``refit_{phase}_seconds_total``), per rep
        self.phases: dict[str, list[float]] = {phase: [] for phase in PHASES}

    def add(self, seconds: float, size: Any, phases: dict[str, float]) -> None:
        self.seconds.append(seconds)
        for phase, took in phases.items():
            self.phases[phase].append(took)
        if size is not None:
            self.sent.append(size.sent_bytes)
            self.whole.append(size.whole_bytes)
            self.deltas.append(size.deltas / max(size.tensors, 1))


PHASES = ("begin", "load", "commit")


def phase_totals(backend: Any) -> dict[str, float]:
    """The backend's committed refits' seconds so far, per phase."""
    metrics = backend.get_logger_metrics()
    return {phase: float(metrics.get(f"refit_{phase}_seconds_total", 0.0)) for phase in PHASES}


def timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(
    label: str,
    reps: int,
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    senders: dict[str, tuple[Any, bool | None, dict[str, torch.Tensor] | None]],
) -> dict[str, Timed]:
    """``senders``: name -> (a Refitter or WeightBroadcaster, its deltas setting, the weights to
    send if not ``after`` (weights in shared memory)). Each repetition puts every backend back on
    ``before`` (untimed), then times every sender's refit of ``after``, in turn."""
    results = {name: Timed() for name in senders}
    for _ in range(reps):
        for name, (sender, deltas, weights) in senders.items():
            if deltas is not None:
                sender.deltas = deltas
            sender.refit(before)  # untimed: the backend and the record on the previous step
            phases_before = phase_totals(sender.backend)
            seconds = timed(lambda s=sender, w=weights: s.refit(after if w is None else w))
            phases_after = phase_totals(sender.backend)
            took = {p: phases_after[p] - phases_before[p] for p in PHASES}
            results[name].add(seconds, sender.last_size, took)
    for name, timing in results.items():
        print(f"  {label:12s} {name:28s} {_summary(timing)}", flush=True)
    return results


def _summary(timing: Timed) -> str:
    secs = timing.seconds
    text = f"{statistics.median(secs):.3f} s ({min(secs):.3f}-{max(secs):.3f})"
    if timing.sent:
        text += (
            f", {statistics.median(timing.sent) / MIB:.1f} MiB sent "
            f"({statistics.median(timing.sent) / statistics.median(timing.whole):.1%} of whole), "
            f"{statistics.median(timing.deltas):.0%} of tensors as deltas"
        )
    phases = {p: statistics.median(v) for p, v in timing.phases.items() if v}
    if phases:
        trainer = statistics.median(secs) - sum(phases.values())
        text += "; " + ", ".join(f"{p} {v:.3f}" for p, v in phases.items())
        text += f", the rest (trainer and transport) {trainer:.3f} s"
    return text


def collective_and_shm(args: argparse.Namespace, path: str, before: dict, after: dict) -> list:
    rows = []
    (plain, plain_cluster), (keeping, keeping_cluster) = (
        vllm_backend(path, False),
        vllm_backend(path, True),
    )
    paths = set(args.paths.split(","))
    try:
        print(
            f"gen-vllm with weight_deltas keeps {keeping.committed_copy_bytes / MIB:.0f} MiB per "
            "worker",
            flush=True,
        )
        if "collective" in paths:
            to_plain = WeightBroadcaster.connect(plain, host="127.0.0.1", deltas=False)
            to_keeping = WeightBroadcaster.connect(keeping, host="127.0.0.1")
            for lr, (new, share) in after.items():
                result = measure(
                    f"lr {lr:g}",
                    args.reps,
                    before,
                    new,
                    {
                        "collective whole": (to_plain, False, None),
                        "collective delta": (to_keeping, True, None),
                        "collective whole, copy kept": (to_keeping, False, None),
                    },
                )
                rows += _rows("collective", lr, share, result)
            to_plain.close()
            to_keeping.close()
        if "shm" in paths:
            for lr, (new, share) in after.items():
                in_shm, shared = share_tensors(new)
                with (
                    shared,
                    Refitter(plain, deltas=False) as streamed,
                    Refitter(keeping, deltas=True) as delta,
                ):
                    result = measure(
                        f"lr {lr:g}",
                        args.reps,
                        before,
                        new,
                        {
                            "shm whole": (streamed, False, None),
                            "shm whole in place": (streamed, False, in_shm),
                            "shm delta": (delta, True, None),
                        },
                    )
                rows += _rows("shm", lr, share, result)
    finally:
        plain.shutdown()
        keeping.shutdown()
        keeping_cluster.shutdown()
        plain_cluster.shutdown()
    return rows


def through_remote(args: argparse.Namespace, path: str, before: dict, after: dict) -> list:
    rows = []
    servers = [gen_serve(path, False), gen_serve(path, True)]
    try:
        plain, keeping = remote(servers[0].url), remote(servers[1].url)
        to_plain = WeightBroadcaster.connect(plain, host="127.0.0.1", deltas=False)
        to_keeping = WeightBroadcaster.connect(keeping, host="127.0.0.1")
        for lr, (new, share) in after.items():
            result = measure(
                f"lr {lr:g}",
                args.reps,
                before,
                new,
                {
                    "remote collective whole": (to_plain, False, None),
                    "remote collective delta": (to_keeping, True, None),
                    "remote collective whole, copy kept": (to_keeping, False, None),
                },
            )
            rows += _rows("remote", lr, share, result)
        to_plain.close()
        to_keeping.close()
        plain.shutdown()
        keeping.shutdown()
    finally:
        for server in servers:
            server.stop()
    return rows


def _rows(path: str, lr: float, share: float, result: dict[str, Timed]) -> list[dict]:
    whole = statistics.median(next(iter(result.values())).seconds)
    out = []
    for name, timing in result.items():
        median = statistics.median(timing.seconds)
        out.append(
            {
                "path": path,
                "lr": lr,
                "share_changed": share,
                "name": name,
                "seconds_median": median,
                "seconds_min": min(timing.seconds),
                "seconds_max": max(timing.seconds),
                "time_ratio": median / whole,
                "sent_mib": statistics.median(timing.sent) / MIB if timing.sent else None,
                "byte_ratio": (
                    statistics.median(timing.sent) / statistics.median(timing.whole)
                    if timing.sent
                    else None
                ),
                "delta_share": statistics.median(timing.deltas) if timing.deltas else None,
                **{
                    f"{p}_seconds_median": statistics.median(v)
                    for p, v in timing.phases.items()
                    if v
                },
            }
        )
    return out


def main() -> list[dict]:
    args = parse_args()
    model = build_tiny_model(args.model)
    path = str(model.path)
    print(f"{args.model}: {model.spec.parameter_count() / 1e6:.0f}M parameters", flush=True)
    before, after = train(args, path)
    rows = []
    paths = set(args.paths.split(","))
    if paths & {"collective", "shm"}:
        rows += collective_and_shm(args, path, before, after)
    if "remote" in paths:
        rows += through_remote(args, path, before, after)
    print()
    print(
        "| path | lr | values changed | refit | s (median, min-max) | x whole | MiB sent "
        "| x whole bytes | tensors as deltas |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['lr']:g} | {r['share_changed']:.2%} | {r['name']} | "
            f"{r['seconds_median']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f}) | "
            f"{r['time_ratio']:.2f} | "
            + (
                f"{r['sent_mib']:.1f} | {r['byte_ratio']:.3f} | {r['delta_share']:.0%} |"
                if r["sent_mib"] is not None
                else "- | - | - |"
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
