"""How fast a refit moves a trainer's weights into a backend, against a plain memory copy.

    uv run python tools/bench/refit.py [--models bench-160m,bench-250m] [--reps 3]

For each random float32 model, in one run:

- a plain copy of the same tensors (``dst.copy_(src)``): the ceiling of any refit;
- bare vLLM's own in-process ``reload_weights(weights_iterator=...)`` of the same tensors
  (``bare``: no transport, no checks, vLLM's weight processing included): the floor any vLLM refit
  pays. One engine per model, its reload timed inside every gen-vllm section beside that section's
  paths (this machine's speed drifts from one section to the next); its memory counts as the
  trainer's there. Beside it, the same reload after the two verified copies a streamed refit adds
  (``bare reload + verified copies``, ``refit_ceiling.py``);
- every refit path into gen-hf and into gen-vllm with one and with two replicas, each repeated and
  interleaved with the copy so that load from elsewhere falls on all alike. Paths: ``refit``
  (streamed through reusable shared-memory buckets, of the shape the backend states it loads
  fastest with unless ``--bucket-mib`` / ``--buffers`` say otherwise), ``in place`` (the same
  refit of weights that already live in shared memory, ``share_tensors``: no trainer-side copy),
  ``one-shot`` (``share_weights`` + one ``update_weights_from_ipc_handles``), for gen-hf
  ``handed over`` (``Refitter``'s default for a backend in this process: the tensors themselves
  in one ``update_weights_from_state_dict``, no bucket), and for vLLM ``collective``
  (``WeightBroadcaster`` over gloo). Every path is a complete transaction, verified by checksums
  wherever bytes cross a bucket;
- beside gen-hf's paths, two ``ceiling`` rows: the copies and checksums of a streamed refit alone,
  with no handles, transaction or backend (``refit_ceiling.py``), in gen-hf's bucket shape and in
  small buckets that stay in the last-level cache. No streamed refit through buckets beats them on
  the machine it runs on.

With ``--lora-rank R``, gen-hf and gen-vllm also serve a LoRA adapter of rank R on every
projection (q, k, v, o, gate, up, down), and each reports an adapter-only refit (its bytes and
seconds) beside a full refit of the same model into the same backend.

Reports, per path, the best time, GB/s (model bytes / seconds), the ratio to the copy's GB/s,
the ratio of its time to bare vLLM's reload of the same model,
the peak extra memory of the trainer (this process's private memory plus shared memory in
use) and of a worker (the worker process's private memory; the backend's own process for HF),
and for every path that is one committed refit, where its best time went: the backend's
``begin``, ``load`` (inside its loads: the calls, the checks, the engine's own load) and
``commit`` (its metrics), and the rest, the ``trainer``'s (filling buckets while nothing loads).
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch
from gen_backend_kit.lora import adapter_specs
from gen_backend_kit.metrics import REFIT_PHASES
from gen_interface import configure_generation_config
from gen_interface.weights import Refitter, WeightBroadcaster, share_tensors, share_weights
from gen_testkit.models import build_tiny_model
from refit_ceiling import ceiling_paths, verified_reload_floor

GB = 1e9  # GB/s in decimal gigabytes
MIB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bench-160m,bench-250m", help="testkit presets")
    parser.add_argument(
        "--backends", default="bare,hf,vllm1,vllm2", help="bare (vLLM's reload), hf, vllm1, vllm2"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every path")
    parser.add_argument(
        "--bucket-mib", type=int, default=None, help="streaming bucket size (default: backend's)"
    )
    parser.add_argument(
        "--buffers", type=int, default=None, help="streaming buckets per place (default: backend's)"
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="also time adapter-only refits of this rank"
    )
    parser.add_argument(
        "--plot", metavar="FILE", help="draw seconds against model size per path (plots.refit)"
    )
    return parser.parse_args()


class MemoryPeak:
    """Samples private memory (RssAnon) of some processes and shared memory in use; keeps peaks
    above the start."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.base = self._now()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def extra(self, key: str) -> int:
        return self.peak[key] - self.base[key]

    def _sample(self) -> None:
        while not self._stop.is_set():
            for key, value in self._now().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(0.01)  # often enough for buckets; rarer would miss nothing they hold

    def _now(self) -> dict[str, int]:
        out = {name: _rss_anon(pid) for name, pid in self.pids.items()}
        shm = os.statvfs("/dev/shm")
        out["shm"] = (shm.f_blocks - shm.f_bfree) * shm.f_frsize
        return out


def _rss_anon(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^RssAnon:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


#: The path of bare vLLM's own reload, when it is timed beside a backend's paths.
BARE_RELOAD = "bare vLLM reload_weights"
#: Bare vLLM's reload after the two verified copies a streamed refit adds (``refit_ceiling``).
BARE_VERIFIED = "bare reload + verified copies"


def refit_phases(backend: Any) -> dict[str, float]:
    """The backend's committed refits so far, and their seconds per phase (its metrics)."""
    metrics = backend.get_logger_metrics() if hasattr(backend, "get_logger_metrics") else {}
    keys = ["refits_total", *(f"refit_{phase}_seconds_total" for phase in REFIT_PHASES)]
    return {key: float(metrics.get(key, 0.0)) for key in keys}


def phase_split(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """Where one timed path's seconds went, when it was one committed refit: the backend's
    begin, load and commit (loads: the call, the checks and the engine's own load), and the
    rest, the trainer's (filling buckets while nothing loads). Empty for other paths."""
    if after["refits_total"] - before["refits_total"] != 1:
        return {}
    split = {
        phase: after[f"refit_{phase}_seconds_total"] - before[f"refit_{phase}_seconds_total"]
        for phase in REFIT_PHASES
    }
    return {**split, "trainer": seconds - sum(split.values())}


def timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class BareVllm:
    """A bare in-process ``vllm.LLM``: its own ``reload_weights`` is the floor of a vLLM refit."""

    def __init__(self, model_path: str):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=1 << 28,
            enable_chunked_prefill=False,
        )

    def reload(self, weights: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights.items())}
        )

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def build_backend(kind: str, model_path: str, lora: dict[str, Any] | None = None) -> Any:
    tokenizer = type("Ids", (), {"pad_token_id": 0, "eos_token_id": 2})()
    config: dict[str, Any] = {
        "backend": "hf" if kind == "hf" else "vllm",
        "model_name": model_path,
        "max_new_tokens": 4,
        "dtype": "float32",
        "stop_token_ids": [],
        "lora": lora,
    }
    if kind == "hf":
        from gen_hf import HfGeneration

        return HfGeneration(
            configure_generation_config(dict(config, hf_cfg={"device": "cpu"}), tokenizer)
        )
    from gen_vllm import VllmGeneration

    config["vllm_cfg"] = {"cpu_kv_cache_gib": 0.25}
    return VllmGeneration.create(
        configure_generation_config(config, tokenizer),
        replicas=int(kind.removeprefix("vllm")),
        use_gpus=False,
    )


def worker_pid(kind: str, backend: Any) -> int:
    return os.getpid() if kind in ("hf", "bare") else backend.replicas.infos[0]["pid"]


def paths_for(
    kind: str, backend: Any, args: argparse.Namespace, in_shm: dict[str, torch.Tensor]
) -> dict[str, Callable[[dict], Any]]:
    if kind == "bare":
        return {"reload_weights": backend.reload}
    bucket = None if args.bucket_mib is None else args.bucket_mib * MIB
    # keeps its buckets, as a training loop would; buckets even where the backend shares this
    # process (its default there is the hand-over, timed as a path of its own)
    refitter = Refitter(backend, bucket_bytes=bucket, buffers=args.buffers, hand_over=False)
    in_place = Refitter(backend, hand_over=False)

    def one_shot(weights: dict) -> None:
        with share_weights(weights) as shared:
            backend.update_weights_from_ipc_handles(shared.handles)

    paths: dict[str, Callable[[dict], Any]] = {
        f"refit {refitter.buffers} x {refitter.bucket_bytes // MIB} MiB": refitter.refit,
        "refit in place": lambda _: in_place.refit(in_shm),
        "one-shot shm": one_shot,
    }
    if kind == "hf":  # beside it, the same copies with no layers: the ceiling of any of them
        targets = {name: torch.zeros_like(tensor) for name, tensor in in_shm.items()}
        paths.update(ceiling_paths(targets, refitter.bucket_bytes))
        paths["refit, handed over"] = Refitter(backend).refit  # no bucket: the default here
    else:
        broadcaster = WeightBroadcaster.connect(backend, host="127.0.0.1", timeout_s=600)
        paths["collective (gloo)"] = broadcaster.refit
    return paths


def measure(
    kind: str, preset: str, weights: dict, args: argparse.Namespace, bare: BareVllm | None = None
) -> list[dict]:
    """Every path into one backend, interleaved with the copy, ``args.reps`` times; with
    ``bare``, its reload too (the floor, measured beside the paths it is the floor of)."""
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    copies = {k: torch.empty_like(v) for k, v in weights.items()}

    def copy() -> None:
        for name, tensor in weights.items():
            copies[name].copy_(tensor)

    copy()
    backend = bare if kind == "bare" else build_backend(kind, str(build_tiny_model(preset).path))
    in_shm, shared = share_tensors(weights)  # the trainer's weights, kept in shared memory
    try:
        paths = paths_for(kind, backend, args, in_shm)
        if bare is not None and kind != "bare":
            floor = verified_reload_floor(bare.reload, backend.capabilities.refit_bucket_bytes)
            paths = {BARE_RELOAD: bare.reload, BARE_VERIFIED: floor, **paths}
        best = dict.fromkeys(paths, float("inf"))
        phases: dict[str, dict[str, float]] = {}  # of each path's best repetition
        best_copy = float("inf")
        memory: dict[str, tuple[int, int]] = {}
        pids = {"trainer": os.getpid(), "worker": worker_pid(kind, backend)}
        for _ in range(args.reps):
            best_copy = min(best_copy, timed(copy))
            for name, run in paths.items():
                before = refit_phases(backend)
                with MemoryPeak(pids) as peak:
                    seconds = timed(lambda run=run: run(weights))
                if seconds < best[name]:
                    best[name] = seconds
                    phases[name] = phase_split(before, refit_phases(backend), seconds)
                # HF and bare vLLM run in this process: its memory counts as the worker's.
                private = peak.extra("trainer") if kind not in ("hf", "bare") else 0
                trainer, worker = memory.get(name, (0, 0))  # the largest over repetitions:
                memory[name] = (  # the first streamed refit allocates the buckets it keeps
                    max(trainer, peak.extra("shm") + private),
                    max(worker, peak.extra("worker")),
                )
    finally:
        if kind != "bare":
            backend.shutdown()
        shared.close()
    copy_gbs = nbytes / best_copy / GB
    label = {"bare": "bare vLLM", "hf": "gen-hf", "vllm1": "gen-vllm x1", "vllm2": "gen-vllm x2"}[
        kind
    ]
    rows = []
    for name, seconds in best.items():
        gbs = nbytes / seconds / GB
        rows.append(
            {
                "model": preset,
                "backend": label,
                "path": name,
                "seconds": seconds,
                "gb_s": gbs,
                "copy_gb_s": copy_gbs,
                "ratio": gbs / copy_gbs,
                "trainer_extra_mib": memory[name][0] / MIB,
                "worker_extra_mib": memory[name][1] / MIB,
            }
        )
        split = phases.get(name)
        print(
            f"  {label:12s} {name:24s} {seconds:7.3f} s {gbs:6.2f} GB/s  x{gbs / copy_gbs:.2f} "
            f"of copy ({copy_gbs:.2f} GB/s)  trainer +{memory[name][0] / MIB:.0f} MiB  worker "
            f"+{memory[name][1] / MIB:.0f} MiB"
            + ("  [" + ", ".join(f"{k} {v:.3f}" for k, v in split.items()) + "]" if split else ""),
            flush=True,
        )
    return rows


#: The layers an RL LoRA usually adapts: every projection of attention and the MLP.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure_adapter(kind: str, preset: str, weights: dict, args: argparse.Namespace) -> None:
    """A full refit and an adapter-only refit into one backend serving an adapter, best of
    ``args.reps`` each, interleaved."""
    rank = args.lora_rank
    settings = {"rank": rank, "alpha": 2.0 * rank, "target_modules": LORA_TARGETS}
    specs = adapter_specs({n: (t.shape, t.dtype) for n, t in weights.items()}, settings)
    generator = torch.Generator().manual_seed(0)
    lora = {n: 0.01 * torch.randn(s, generator=generator) for n, (s, _) in specs.items()}
    sizes = {
        "full": sum(t.numel() * t.element_size() for t in weights.values()),
        "adapter": sum(t.numel() * t.element_size() for t in lora.values()),
    }
    backend = build_backend(kind, str(build_tiny_model(preset).path), lora=settings)
    best = dict.fromkeys(sizes, float("inf"))
    try:
        with Refitter(backend) as refitter:
            for _ in range(args.reps):
                best["full"] = min(best["full"], timed(lambda: refitter.refit(weights)))
                best["adapter"] = min(best["adapter"], timed(lambda: refitter.refit(lora)))
    finally:
        backend.shutdown()
    label = {"hf": "gen-hf", "vllm1": "gen-vllm x1", "vllm2": "gen-vllm x2"}[kind]
    print(
        f"  {label:12s} LoRA rank {rank}: full refit {sizes['full'] / MIB:.0f} MiB in "
        f"{best['full']:.3f} s; adapter refit {sizes['adapter'] / MIB:.1f} MiB in "
        f"{best['adapter']:.3f} s ({best['full'] / best['adapter']:.0f}x faster)",
        flush=True,
    )


def main() -> list[dict[str, Any]]:
    args = parse_args()
    rows: list[dict[str, Any]] = []
    for preset in args.models.split(","):
        model = build_tiny_model(preset)
        weights = {k: v.contiguous() for k, v in model.state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        print(
            f"{preset}: {model.spec.parameter_count() / 1e6:.0f}M parameters, "
            f"{nbytes / GB:.2f} GB float32",
            flush=True,
        )
        kinds = args.backends.split(",")
        # One bare engine per model, its reload timed beside every vLLM backend's paths (alone
        # only when no vLLM backend is asked for): this machine's speed drifts between sections.
        bare = BareVllm(str(model.path)) if "bare" in kinds else None
        vllm_kinds = [k for k in kinds if k.startswith("vllm")]
        try:
            for kind in kinds:
                if kind == "bare" and vllm_kinds:
                    continue
                rows.extend(measure(kind, preset, weights, args, bare if kind != "hf" else None))
                if args.lora_rank and kind != "bare":
                    measure_adapter(kind, preset, weights, args)
        finally:
            if bare is not None:
                bare.shutdown()
    print()
    floor = {
        (r["model"], r["backend"]): r["seconds"]
        for r in rows
        if r["path"] in (BARE_RELOAD, "reload_weights")
    }
    print(
        "| model | backend | path | s | GB/s | ratio to copy | time / bare vLLM reload "
        "| trainer +MiB | worker +MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        section = (r["model"], r["backend"])
        to_floor = f"{r['seconds'] / floor[section]:.2f}" if section in floor else "-"
        print(
            f"| {r['model']} | {r['backend']} | {r['path']} | {r['seconds']:.3f} | "
            f"{r['gb_s']:.2f} | {r['ratio']:.2f} (copy {r['copy_gb_s']:.2f} GB/s) | {to_floor} | "
            f"{r['trainer_extra_mib']:.0f} | {r['worker_extra_mib']:.0f} |"
        )
    if args.plot:
        import plots

        reps = f"{args.reps} repetition" + ("s" if args.reps != 1 else "")
        print(f"wrote {plots.refit(rows, args.plot, f'the fastest of {reps}')}")
    return rows


if __name__ == "__main__":
    main()
