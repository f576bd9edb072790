"""``gen-parity``: every installed backend through the interface, on one model, side by side.

    uv run gen-parity                       # a tiny random model, every installed backend
    uv run gen-parity --model DIR --backends hf,vllm --dtype bfloat16 --json parity.json
    uv run gen-parity --batch-invariant     # backends that offer it run batch-invariant
    uv run gen-parity --plot parity-plots   # pictures of every pair, and an HTML page
    uv run gen-parity --verbose             # the engines' and Ray's own logs here too

The "exact" column is each backend's share of greedy logprobs equal, bit for bit, to the
trainer-side exact forward (``gen_hf.exact.sequence_logprobs``); ``*`` marks a backend
running with ``batch_invariant: true``, which fails unless its share is 1.

What it prints is its own progress and the table. vLLM's, Ray's and SGLang's output, and
libraries' deprecation warnings, go to a log file whose path it prints first
(``GEN_LOG_FILE`` names another); ``--verbose`` or ``GEN_VERBOSE=1`` shows them instead.

Exits 0 when every pair passes its tolerances, 1 when one does not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gen_interface import (
    BackendUnavailableError,
    GenerationConfigError,
    GenerationInterface,
    available_backends,
    configure_generation_config,
    create_generation_backend,
)

from gen_testkit.console import Console
from gen_testkit.engine_logs import LOG_FILE_ENV, VERBOSE_ENV, route_engine_logs, verbose_requested
from gen_testkit.models import PRESETS, build_tiny_model
from gen_testkit.parity.oracle import HfLogitsOracle
from gen_testkit.parity.report import format_table
from gen_testkit.parity.runner import SIGNIFICANCE, PairReport, TimedBackend, run_pair
from gen_testkit.parity.workload import PARITY_SETTINGS, parity_batches, sampling_plan
from gen_testkit.tolerances import tolerance_for

__all__ = ["main"]

#: Backends that load Hugging Face models, in the order they are preferred as the reference.
MODEL_BACKENDS = ("hf", "vllm", "sglang")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gen-parity", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        help="local Hugging Face model directory, or a testkit preset such as tiny-qwen3-moe "
        "(default: tiny-qwen2); an MoE model's routed experts are compared too",
    )
    parser.add_argument(
        "--backends", help="comma-separated backend names (default: every installed one)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--samples", type=int, default=600, help="samples per sampling prefix")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON here")
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="write pictures of every pair (PNG) and index.html holding them into DIR "
        "(default with --json FILE: FILE's name without .json, plus -plots)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"show the engines' and Ray's own logs here ({VERBOSE_ENV}=1 does too) instead of "
        f"in the log file (printed first; {LOG_FILE_ENV} names another)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="start each backend with batch_invariant: true where it offers it (others as usual)",
    )
    parser.add_argument(
        "--lm-head-fp32",
        action="store_true",
        help="start each backend with lm_head_fp32: true (the head in float32; compare a run "
        "with and one without in the 'vs float32' column of a --dtype bfloat16 run)",
    )
    return parser


def _start(
    name: str, settings: dict[str, Any], tokenizer: Any, batch_invariant: bool, progress: Any
) -> GenerationInterface:
    """The backend ``name``; with ``batch_invariant``, in that mode if it accepts it."""
    if batch_invariant:
        try:
            config = configure_generation_config({**settings, "batch_invariant": True}, tokenizer)
            return create_generation_backend(config)
        except (GenerationConfigError, BackendUnavailableError) as exc:
            progress(f"{name} runs without batch_invariant: {exc}")
    return create_generation_backend(configure_generation_config(settings, tokenizer))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    progress = console.line

    installed = [name for name in MODEL_BACKENDS if name in available_backends()]
    names = args.backends.split(",") if args.backends else installed
    unknown = [n for n in names if n not in installed]
    if unknown or not names:
        print(
            f"gen-parity: cannot run {unknown or names}; installed model backends: {installed}",
            file=sys.stderr,
        )
        return 2
    plots = _plot_directory(args)
    if plots is not None and not _can_plot():
        print(
            "gen-parity: --plot needs matplotlib: install gen-testkit[plots] (`uv sync` in this "
            "workspace does)",
            file=sys.stderr,
        )
        return 2
    log_file = route_engine_logs(args.verbose or verbose_requested(), "gen-parity")
    if log_file is not None:
        progress(f"engine and Ray logs: {log_file} (--verbose shows them here)")
    if args.model is None or args.model in PRESETS:
        preset = args.model or "tiny-qwen2"
        with console.step(f"building (or reusing) the {preset} model"):
            args.model = str(build_tiny_model(preset).path)

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model_config = AutoConfig.from_pretrained(args.model)
    vocab_size = model_config.vocab_size
    # an MoE model: the backends return their routing, checked against transformers' routers
    routing = {"return_routed_experts": True} if _is_moe(model_config) else {}
    backends: list[TimedBackend] = []
    reports: list[PairReport] = []
    try:
        for name in names:
            settings = {
                "backend": name,
                "model_name": args.model,
                "dtype": args.dtype,
                **PARITY_SETTINGS,
                **routing,
                "lm_head_fp32": args.lm_head_fp32,
            }
            with console.step(f"starting backend {name} ({args.dtype})"):
                backend = _start(name, settings, tokenizer, args.batch_invariant, progress)
            backend.clear_logger_metrics()
            backends.append(TimedBackend(name, backend))
        with console.step(f"loading the exact logits (a transformers forward pass, {args.dtype})"):
            oracle = HfLogitsOracle(args.model, args.dtype)
            float32 = None if args.dtype == "float32" else HfLogitsOracle(args.model, "float32")
        batches = parity_batches(vocab_size)
        plan = sampling_plan(vocab_size, args.samples)
        reference = backends[0]
        # A single backend is compared with itself: still checks it against the exact logits.
        others = backends[1:] or [TimedBackend(f"{reference.name}'", reference.backend)]
        steps = len(batches) + len(plan.prefixes)
        for candidate in others:
            progress(f"comparing {candidate.name} with {reference.name}")
            with console.bar(f"{candidate.name} vs {reference.name}", steps) as advance:
                reports.append(
                    run_pair(
                        reference,
                        candidate,
                        oracle=oracle,
                        batches=batches,
                        plan=plan,
                        tolerance=tolerance_for(args.dtype, across_backends=True),
                        dtype=args.dtype,
                        progress=progress,
                        float32=float32,
                        advance=advance,
                    )
                )
    finally:
        for timed in backends:
            timed.backend.shutdown()

    console.print()
    console.print(format_table(reports))
    console.print(
        f"\nsampling: chi-square goodness of fit, significance {SIGNIFICANCE:g}; "
        f"tolerances ({args.dtype}): {vars(reports[0].tolerance)}"
    )
    for report in reports:
        for failure in report.failures:
            console.print(f"FAIL {report.reference} vs {report.candidate}: {failure}")
    if args.json:
        payload: dict[str, Any] = {
            "model": args.model,
            "dtype": args.dtype,
            "settings": PARITY_SETTINGS,
            "seconds": console.elapsed,
            "pairs": [r.as_dict() for r in reports],
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
        progress(f"wrote {args.json}")
    if plots is not None:
        from gen_testkit.parity.plots import write_plots

        with console.step(f"drawing the pictures into {plots}"):
            page = write_plots(reports, plots)
        progress(f"wrote {page}")
    progress("done")
    return 0 if all(r.ok for r in reports) else 1


def _plot_directory(args: argparse.Namespace) -> Path | None:
    """``--plot``, or beside ``--json FILE`` (``FILE`` without ``.json``, plus ``-plots``) when
    matplotlib is installed."""
    if args.plot:
        return Path(args.plot)
    if args.json and _can_plot():
        path = Path(args.json)
        return path.with_name(f"{path.stem}-plots")
    return None


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _is_moe(model_config: Any) -> bool:
    return bool(getattr(model_config, "num_experts_per_tok", 0))


if __name__ == "__main__":
    sys.exit(main())
