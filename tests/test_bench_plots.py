"""``tools/bench/plots.py``: each benchmark's curves render from the rows its script makes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from bench import plots

_PNG = b"\x89PNG\r\n\x1a\n"


def _is_picture(path: Path) -> bool:
    return path.read_bytes()[:8] == _PNG and path.stat().st_size > 10_000


def test_serving_curves(tmp_path: Path):
    points = [
        {"server": s, "concurrency": c, "tokens_s": f * c, "ttft_p50_s": c / 8, "ttft_p99_s": c / 4}
        for s, f in (("vllm-serve", 10.0), ("gen-serve", 12.0))
        for c in (8, 16, 32, 64)
    ]
    assert _is_picture(plots.serving(points, tmp_path / "serve.png", "bench-50m"))


def test_refit_curves(tmp_path: Path):
    rows = [
        {"model": f"m{gb}", "backend": b, "path": p, "seconds": gb / s, "gb_s": s, "copy_gb_s": 8.0}
        for b, p, s in (
            ("gen-hf", "refit", 3.0),
            ("gen-vllm x1", "refit", 2.0),
            ("bare vLLM", "reload_weights", 4.0),
        )
        for gb in (0.64, 1.0)
    ]
    assert _is_picture(plots.refit(rows, tmp_path / "refit.png"))


def test_batch_throughput_curves(tmp_path: Path):
    points = [
        {"generator": g, "batch": b, "tokens_s": f * b, "median_tokens_s": 0.9 * f * b}
        for g, f in (("HfGeneration.generate", 30.0), ("transformers generate", 31.0))
        for b in (1, 4, 16, 32)
    ]
    assert _is_picture(plots.batch_throughput(points, tmp_path / "hf.png"))
