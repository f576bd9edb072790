"""Start-up of a backend from a fresh process: loading the checkpoint against not reading it.

    uv run python tools/bench/startup.py [--model bench-250m] [--backends hf,vllm] [--reps 2]

For gen-hf (``HfGeneration(config)``, on the CPU) and gen-vllm
(``VllmGeneration.create(config, replicas=1, use_gpus=False)``, Ray started by the backend), on
one random float32 testkit model: seconds from a fresh interpreter to the constructor's return
("ready"), with ``load_format`` ``"auto"`` (the checkpoint is read; ``is_eval=True``, the same as
the default) and ``"dummy"`` (``configure_generation_config(config, tokenizer, is_eval=False)``:
the checkpoint is not read, the first weight update brings the weights).

Every start-up runs in its own subprocess; the runs alternate (backend by backend, the order of
the two formats flipped every repetition) so that load from elsewhere falls on all alike. The
model is built once, here, before any run, so building it is not measured. Times per run:
"ready", from the child's first statement (before its imports) to ready, split into "imports"
(to the backend's package imported) and "build" (the config and the constructor: the part
``load_format`` changes); and "parent", from launching the child to its ready (the interpreter's
own start-up included). After ready the child calls ``generate`` once (one 3-token prompt,
greedy): with ``"dummy"`` it must raise ``WeightsAbsentError`` ("refused"), with ``"auto"`` it
runs; then it shuts the backend down.

Prints best and median seconds of every backend and format, and the ratios dummy / auto of the
ready and build times per backend. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import time

_CHILD_T0 = time.time()  # before any import: the child's clock starts here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, cast  # noqa: E402

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

BACKENDS = {"hf": "gen-hf", "vllm": "gen-vllm x1"}
FORMATS = ("auto", "dummy")
_RESULT = "STARTUP-RESULT "


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="bench-250m", help="testkit preset")
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated: hf, vllm")
    parser.add_argument("--reps", type=int, default=2, help="start-ups of every backend/format")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child run")
    return parser.parse_args()


# ---- the child: one start-up -------------------------------------------------------------------


def backend_class(kind: str) -> Any:
    """Import the backend ``kind`` (and gen-interface with it); return its class."""
    if kind == "hf":
        from gen_hf import HfGeneration

        return HfGeneration
    from gen_vllm import VllmGeneration

    return VllmGeneration


def build_backend(kind: str, load_format: str, model_path: str) -> Any:
    """The backend ``kind`` on ``model_path``, its load_format chosen through ``is_eval``."""
    from types import SimpleNamespace

    from gen_interface import configure_generation_config

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    config: dict[str, Any] = {
        "backend": kind,
        "model_name": model_path,
        "max_new_tokens": 4,
        "dtype": "float32",
        "stop_token_ids": [],
    }
    is_eval = load_format == "auto"
    if kind == "hf":
        from gen_hf import HfConfig, HfGeneration

        config["hf_cfg"] = {"device": "cpu"}
        hf_config = cast(HfConfig, config)
        return HfGeneration(configure_generation_config(hf_config, tokenizer, is_eval=is_eval))
    from gen_vllm import VllmConfig, VllmGeneration

    config["vllm_cfg"] = {"cpu_kv_cache_gib": 0.25}
    vllm_config = cast(VllmConfig, config)
    return VllmGeneration.create(
        configure_generation_config(vllm_config, tokenizer, is_eval=is_eval),
        replicas=1,
        use_gpus=False,
    )


def generate_before_update(backend: Any) -> str:
    """``"refused"`` (WeightsAbsentError), ``"ran"``, or the name of another error."""
    import torch
    from gen_interface import BatchedDataDict, WeightsAbsentError

    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.tensor([[5, 6, 7]]), input_lengths=torch.tensor([3])
    )
    try:
        backend.generate(batch, greedy=True)
    except WeightsAbsentError:
        return "refused"
    except Exception as exc:  # reported, not hidden: the table shows what went wrong
        return f"error: {type(exc).__name__}: {exc}"
    return "ran"


def child(kind: str, load_format: str, model_path: str) -> None:
    """Start one backend, print when it was ready as one JSON line, check generate, shut down."""
    backend_class(kind)
    imported = time.time()
    backend = build_backend(kind, load_format, model_path)
    ready = time.time()
    try:
        generate = generate_before_update(backend)
    finally:
        start = time.time()
        backend.shutdown()
        shutdown_s = time.time() - start
    result = {
        "ready_s": ready - _CHILD_T0,
        "import_s": imported - _CHILD_T0,
        "ready_epoch": ready,
        "generate": generate,
        "shutdown_s": shutdown_s,
    }
    print(_RESULT + json.dumps(result), flush=True)


# ---- the parent: runs, statistics, table -------------------------------------------------------


@dataclass
class Run:
    child_s: float  # child's first statement to ready
    import_s: float  # child's first statement to the backend's package imported
    parent_s: float  # launching the child to its ready
    total_s: float  # launching the child to its exit (generate check and shutdown included)
    generate: str

    @property
    def build_s(self) -> float:
        """The config and the constructor alone: what ``load_format`` changes."""
        return self.child_s - self.import_s


def run_child(kind: str, load_format: str, model_path: str, timeout: float) -> Run:
    """One start-up in a fresh interpreter; raises with the child's output when it fails."""
    command = [sys.executable, os.path.abspath(__file__), "--child", kind, load_format, model_path]
    launched = time.time()
    process = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    total = time.time() - launched
    lines = [line for line in process.stdout.splitlines() if line.startswith(_RESULT)]
    if process.returncode != 0 or not lines:
        raise RuntimeError(
            f"{kind}/{load_format} start-up failed (exit code {process.returncode}):\n"
            f"--- stdout ---\n{process.stdout[-4000:]}\n--- stderr ---\n{process.stderr[-8000:]}"
        )
    result = json.loads(lines[-1].removeprefix(_RESULT))
    return Run(
        child_s=result["ready_s"],
        import_s=result["import_s"],
        parent_s=result["ready_epoch"] - launched,
        total_s=total,
        generate=result["generate"],
    )


def main() -> None:
    args = parse_args()
    from gen_testkit.models import build_tiny_model

    began = time.perf_counter()
    model = build_tiny_model(args.model)  # built (or found in the cache) once, before any run
    size = (model.path / "model.safetensors").stat().st_size
    print(
        f"{args.model}: {model.spec.parameter_count() / 1e6:.0f}M parameters, "
        f"{size / 1e9:.2f} GB checkpoint, {model.path}; load average "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        flush=True,
    )
    kinds = args.backends.split(",")
    unknown = sorted(set(kinds) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown backends {unknown}; choose from {sorted(BACKENDS)}")
    runs: dict[tuple[str, str], list[Run]] = {(k, f): [] for k in kinds for f in FORMATS}
    for rep in range(args.reps):
        for kind in kinds:
            for load_format in FORMATS if rep % 2 == 0 else FORMATS[::-1]:
                run = run_child(kind, load_format, str(model.path), args.timeout)
                runs[kind, load_format].append(run)
                print(
                    f"  rep {rep + 1} {BACKENDS[kind]:11s} {load_format:5s} ready "
                    f"{run.child_s:6.2f} s (imports {run.import_s:5.2f} s + build "
                    f"{run.build_s:6.2f} s; parent {run.parent_s:6.2f} s, exit "
                    f"{run.total_s:6.2f} s)  generate before update: {run.generate}",
                    flush=True,
                )

    print(
        f"\n{args.model}, {args.reps} start-ups each, seconds from a fresh process to ready "
        "(constructor returned); load average (1, 5, 15 min) at the end: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
        + "\n"
    )
    print(
        "| backend | load_format | ready best | ready median | imports median | build best "
        "| build median | parent best | parent median | generate before update |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (kind, load_format), done in runs.items():
        ready, imports, build, parent = (
            [getattr(r, field) for r in done]
            for field in ("child_s", "import_s", "build_s", "parent_s")
        )
        med = statistics.median
        cells = [min(ready), med(ready), med(imports), min(build), med(build)]
        cells += [min(parent), med(parent)]
        generate = ", ".join(sorted({r.generate for r in done}))
        print(
            f"| {BACKENDS[kind]} | {load_format} | "
            + " | ".join(f"{c:.2f}" for c in cells)
            + f" | {generate} |"
        )
    print(
        "\nready: the child's first statement to ready; imports: to the backend's package "
        "imported; build: the rest (config and constructor); parent: launching the child to its "
        "ready."
    )
    print("\n| backend | dummy / auto, ready best | ready median | build best | build median |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        auto, dummy = runs[kind, "auto"], runs[kind, "dummy"]
        ratios = [
            f([getattr(r, field) for r in dummy]) / f([getattr(r, field) for r in auto])
            for field in ("child_s", "build_s")
            for f in (min, statistics.median)
        ]
        print(f"| {BACKENDS[kind]} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    print(f"\ntotal run time {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
