"""How fast a refit moves a trainer's weights into a backend, against a plain memory copy.

    uv run python tools/bench/refit.py [--models bench-160m,bench-250m] [--reps 3] \
        [--deltas [--delta-share 0.01] [--delta-step 1e-5]]

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
  the machine it runs on;
- with ``--deltas`` (off by default: it starts one more gen-vllm backend per replica count and
  model, and the run takes nearly twice as long), delta refits (``weight_changes.py``, as in
  ``delta_refit.py``): the trainer's weights between the previous committed refit and the timed one
  differ in a fixed share of each tensor's values (``--delta-share``, 1%, at seeded random
  positions), each moved up or down by ``--delta-step`` (1e-5: about one AdamW step at lr 1e-5). A
  fixed share, not a real optimizer step: in float32 a step moves nearly every value it updates by
  some bits, and a delta of every value is larger than the tensor (``delta_refit.py`` measures real
  steps, in bfloat16, where a step at lr 1e-6 changed 0.8%). Each delta row first refits the
  unchanged weights, untimed (the backend and the sender's record then hold them), then times the
  refit of the changed ones, sent as deltas. gen-vllm gets a section of its own per replica count
  (``gen-vllm xN, weight_deltas``): a backend started with ``vllm_cfg.weight_deltas`` on (each
  worker keeps a copy of the committed weights), with bare vLLM's reload timed beside it again, and
  rows ``refit ..., delta`` (``Refitter(deltas=True)``, through the same shared-memory buckets),
  ``collective (gloo), delta`` (``WeightBroadcaster``), and for each of them ``whole, copy kept``:
  the same path's whole refit into that backend, which writes the copy too (the time deltas cost a
  refit that falls back to whole). gen-hf takes deltas against its model's own parameters and keeps
  no copy: its ``refit ..., delta`` row sits beside its other paths (its whole rows are its ``whole,
  copy kept``). The line before each such section's rows gives the copies kept for deltas: per
  worker rank (``committed_copy_bytes``) and in the trainer (each sender's record of the weights it
  last sent); the memory columns count what a timed refit adds above them.

With ``--lora-rank R``, gen-hf and gen-vllm also serve a LoRA adapter of rank R on every
projection (q, k, v, o, gate, up, down), and each reports an adapter-only refit (its bytes and
seconds) beside a full refit of the same model into the same backend.

Reports, per path, the best time, GB/s (model bytes / seconds), the ratio to the copy's GB/s,
the ratio of its time to bare vLLM's reload of the same model,
the peak extra memory of the trainer (this process's private memory plus shared memory in
use) and of a worker (the worker process's private memory; the backend's own process for HF),
the bytes its best refit sent as a share of the whole model's (``last_size``: below 100% only
where deltas went; ``-`` for a path with no sender),
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
from dataclasses import dataclass
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
from weight_changes import changed_share, perturbed

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
        "--deltas",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also time delta refits (a section per gen-vllm backend with weight_deltas on)",
    )
    parser.add_argument(
        "--delta-share",
        type=float,
        default=0.01,
        help="share of each tensor's values changed between the two refits of a delta row",
    )
    parser.add_argument(
        "--delta-step",
        type=float,
        default=1e-5,
        help="how far each changed value moves, up or down (one AdamW step at this lr)",
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


@dataclass
class TimedPath:
    """One path of a section: ``run(weights)`` is timed; ``prepare()``, when given, runs untimed
    before every timed run; ``sender``, the path's ``Refitter`` or ``WeightBroadcaster``, when it
    has one: its ``last_size`` gives the bytes the timed refit sent."""

    run: Callable[[dict], Any]
    prepare: Callable[[], Any] | None = None
    sender: Any = None


def build_backend(
    kind: str, model_path: str, lora: dict[str, Any] | None = None, deltas: bool = False
) -> Any:
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

    config["vllm_cfg"] = {"cpu_kv_cache_gib": 0.25, "weight_deltas": deltas}
    return VllmGeneration.create(
        configure_generation_config(config, tokenizer),
        replicas=int(kind.removeprefix("vllm")),
        use_gpus=False,
    )


def worker_pid(kind: str, backend: Any) -> int:
    return os.getpid() if kind in ("hf", "bare") else backend.replicas.infos[0]["pid"]


def paths_for(
    kind: str, backend: Any, args: argparse.Namespace, in_shm: dict[str, torch.Tensor]
) -> dict[str, TimedPath]:
    if kind == "bare":
        return {"reload_weights": TimedPath(backend.reload)}
    bucket = None if args.bucket_mib is None else args.bucket_mib * MIB
    # keeps its buckets, as a training loop would; buckets even where the backend shares this
    # process (its default there is the hand-over, timed as a path of its own)
    refitter = Refitter(backend, bucket_bytes=bucket, buffers=args.buffers, hand_over=False)
    in_place = Refitter(backend, hand_over=False)

    def one_shot(weights: dict) -> None:
        with share_weights(weights) as shared:
            backend.update_weights_from_ipc_handles(shared.handles)

    paths = {
        f"refit {refitter.buffers} x {refitter.bucket_bytes // MIB} MiB": TimedPath(
            refitter.refit, sender=refitter
        ),
        "refit in place": TimedPath(lambda _: in_place.refit(in_shm), sender=in_place),
        "one-shot shm": TimedPath(one_shot),
    }
    if kind == "hf":  # beside it, the same copies with no layers: the ceiling of any of them
        targets = {name: torch.zeros_like(tensor) for name, tensor in in_shm.items()}
        ceilings = ceiling_paths(targets, refitter.bucket_bytes)
        paths.update({name: TimedPath(run) for name, run in ceilings.items()})
        handed_over = Refitter(backend)  # no bucket: the default here
        paths["refit, handed over"] = TimedPath(handed_over.refit, sender=handed_over)
    else:
        broadcaster = WeightBroadcaster.connect(backend, host="127.0.0.1", timeout_s=600)
        paths["collective (gloo)"] = TimedPath(broadcaster.refit, sender=broadcaster)
    return paths


def delta_paths(
    kind: str, backend: Any, args: argparse.Namespace, weights: dict, changed: dict
) -> dict[str, TimedPath]:
    """The delta rows of one backend that keeps a base (gen-hf: its model's own parameters;
    gen-vllm: the copy ``weight_deltas`` keeps). A delta row first refits ``weights`` (untimed:
    the backend and the sender's record then hold them), then times the refit of ``changed``,
    sent as deltas against them. Beside each, for gen-vllm, the same path's whole refit into the
    same backend (``whole, copy kept``: every tensor whole, the copy written too)."""
    bucket = None if args.bucket_mib is None else args.bucket_mib * MIB
    delta = Refitter(
        backend, bucket_bytes=bucket, buffers=args.buffers, hand_over=False, deltas=True
    )
    streamed = f"refit {delta.buffers} x {delta.bucket_bytes // MIB} MiB"
    paths = {
        f"{streamed}, delta": TimedPath(
            lambda _: delta.refit(changed), prepare=lambda: delta.refit(weights), sender=delta
        )
    }
    if kind == "hf":  # no copy kept: gen-hf's whole rows are its whole refits
        return paths
    whole = Refitter(backend, bucket_bytes=bucket, buffers=args.buffers, deltas=False)
    paths[f"{streamed}, whole, copy kept"] = TimedPath(whole.refit, sender=whole)
    # One group per backend: its one broadcaster sends deltas or not as each path sets.
    broadcaster = WeightBroadcaster.connect(backend, host="127.0.0.1", timeout_s=600)

    def broadcast_deltas(on: bool, then: dict | None = None) -> Callable[[], Any]:
        def prepare() -> None:
            broadcaster.deltas = on
            if then is not None:
                broadcaster.refit(then)

        return prepare

    paths["collective (gloo), delta"] = TimedPath(
        lambda _: broadcaster.refit(changed),
        prepare=broadcast_deltas(True, then=weights),
        sender=broadcaster,
    )
    paths["collective (gloo), whole, copy kept"] = TimedPath(
        broadcaster.refit, prepare=broadcast_deltas(False), sender=broadcaster
    )
    return paths


def section_label(kind: str, keeps_copy: bool) -> str:
    label = {"bare": "bare vLLM", "hf": "gen-hf", "vllm1": "gen-vllm x1", "vllm2": "gen-vllm x2"}
    return label[kind] + (", weight_deltas" if keeps_copy else "")


def measure(
    kind: str,
    preset: str,
    weights: dict,
    args: argparse.Namespace,
    bare: BareVllm | None = None,
    changed: dict | None = None,
) -> list[dict]:
    """Every path into one backend, interleaved with the copy, ``args.reps`` times; with
    ``bare``, its reload too (the floor, measured beside the paths it is the floor of).

    With ``changed`` (``weights`` after a small change), the delta rows (``delta_paths``): for
    gen-hf beside its other paths; for gen-vllm in a section of their own, into a backend started
    with ``weight_deltas`` on, in place of the other paths."""
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    copies = {k: torch.empty_like(v) for k, v in weights.items()}

    def copy() -> None:
        for name, tensor in weights.items():
            copies[name].copy_(tensor)

    copy()
    keeps_copy = changed is not None and kind.startswith("vllm")
    if kind == "bare":
        backend = bare
    else:
        model_path = str(build_tiny_model(preset).path)
        backend = build_backend(kind, model_path, deltas=keeps_copy)
    in_shm, shared = share_tensors(weights)  # the trainer's weights, kept in shared memory
    label = section_label(kind, keeps_copy)
    try:
        if keeps_copy:
            assert changed is not None
            paths = delta_paths(kind, backend, args, weights, changed)
        else:
            paths = paths_for(kind, backend, args, in_shm)
            if changed is not None and kind == "hf":
                paths.update(delta_paths(kind, backend, args, weights, changed))
        if bare is not None and kind != "bare":
            floor = verified_reload_floor(bare.reload, backend.capabilities.refit_bucket_bytes)
            paths = {BARE_RELOAD: TimedPath(bare.reload), BARE_VERIFIED: TimedPath(floor), **paths}
        best = dict.fromkeys(paths, float("inf"))
        phases: dict[str, dict[str, float]] = {}  # of each path's best repetition
        sent: dict[str, float] = {}  # bytes sent / whole bytes, of each path's best repetition
        best_copy = float("inf")
        memory: dict[str, tuple[int, int]] = {}
        pids = {"trainer": os.getpid(), "worker": worker_pid(kind, backend)}
        for _ in range(args.reps):
            best_copy = min(best_copy, timed(copy))
            for name, path in paths.items():
                if path.prepare is not None:
                    path.prepare()
                before = refit_phases(backend)
                with MemoryPeak(pids) as peak:
                    seconds = timed(lambda run=path.run: run(weights))
                if seconds < best[name]:
                    best[name] = seconds
                    phases[name] = phase_split(before, refit_phases(backend), seconds)
                    size = getattr(path.sender, "last_size", None)
                    if size is not None:
                        sent[name] = size.sent_bytes / max(size.whole_bytes, 1)
                # HF and bare vLLM run in this process: its memory counts as the worker's.
                private = peak.extra("trainer") if kind not in ("hf", "bare") else 0
                trainer, worker = memory.get(name, (0, 0))  # the largest over repetitions:
                memory[name] = (  # the first streamed refit allocates the buckets it keeps
                    max(trainer, peak.extra("shm") + private),
                    max(worker, peak.extra("worker")),
                )
        if changed is not None:
            records = {id(p.sender): p.sender for p in paths.values() if p.sender is not None}
            held = sum(sender.sent_bytes() for sender in records.values())
            kept = getattr(backend, "committed_copy_bytes", None)
            in_backend = (
                "none in the backend (its model's parameters are the base)"
                if kept is None
                else f"{kept / MIB:.0f} MiB per worker rank"
            )
            print(
                f"  {label}: copies kept for deltas: {in_backend}, {held / MIB:.0f} MiB in the "
                "trainer (its senders' records of what they sent)",
                flush=True,
            )
    finally:
        if kind != "bare":
            backend.shutdown()
        shared.close()
    copy_gbs = nbytes / best_copy / GB
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
                "sent_share": sent.get(name),
            }
        )
        split = phases.get(name)
        share = f"  sent {sent[name]:.1%} of whole" if name in sent else ""
        print(
            f"  {label:12s} {name:36s} {seconds:7.3f} s {gbs:6.2f} GB/s  x{gbs / copy_gbs:.2f} "
            f"of copy ({copy_gbs:.2f} GB/s)  trainer +{memory[name][0] / MIB:.0f} MiB  worker "
            f"+{memory[name][1] / MIB:.0f} MiB{share}"
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
    label = section_label(kind, keeps_copy=False)
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
        changed = None
        if args.deltas and any(k == "hf" or k.startswith("vllm") for k in kinds):
            changed = perturbed(weights, args.delta_share, args.delta_step)
            print(
                f"  delta rows: {changed_share(weights, changed):.2%} of the values changed "
                f"(by {args.delta_step:g})",
                flush=True,
            )
        # One bare engine per model, its reload timed beside every vLLM backend's paths (alone
        # only when no vLLM backend is asked for): this machine's speed drifts between sections.
        bare = BareVllm(str(model.path)) if "bare" in kinds else None
        vllm_kinds = [k for k in kinds if k.startswith("vllm")]
        try:
            for kind in kinds:
                if kind == "bare" and vllm_kinds:
                    continue
                floor = bare if kind != "hf" else None
                rows.extend(
                    measure(kind, preset, weights, args, floor, changed if kind == "hf" else None)
                )
                if changed is not None and kind.startswith("vllm"):
                    rows.extend(measure(kind, preset, weights, args, floor, changed))
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
        "| trainer +MiB | worker +MiB | sent / whole |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        section = (r["model"], r["backend"])
        to_floor = f"{r['seconds'] / floor[section]:.2f}" if section in floor else "-"
        sent = "-" if r["sent_share"] is None else f"{r['sent_share']:.1%}"
        print(
            f"| {r['model']} | {r['backend']} | {r['path']} | {r['seconds']:.3f} | "
            f"{r['gb_s']:.2f} | {r['ratio']:.2f} (copy {r['copy_gb_s']:.2f} GB/s) | {to_floor} | "
            f"{r['trainer_extra_mib']:.0f} | {r['worker_extra_mib']:.0f} | {sent} |"
        )
    if args.plot:
        import plots

        reps = f"{args.reps} repetition" + ("s" if args.reps != 1 else "")
        print(f"wrote {plots.refit(rows, args.plot, f'the fastest of {reps}')}")
    return rows


if __name__ == "__main__":
    main()
