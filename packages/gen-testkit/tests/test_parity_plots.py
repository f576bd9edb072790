"""``gen-parity``'s pictures: every pair gets its four PNGs and a section of the HTML page, and
the page says which pairs failed and why."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from gen_testkit.parity.metrics import LogprobError
from gen_testkit.parity.runner import PairReport
from gen_testkit.parity.trace import SamplingTrace
from gen_testkit.tolerances import tolerance_for

pytest.importorskip("matplotlib", reason="the pictures need gen-testkit[plots]")

from gen_testkit.parity.plots import write_plots

_PNG = b"\x89PNG\r\n\x1a\n"


def _report(candidate: str, scale: float, failures: list[str]) -> PairReport:
    """A pair with made-up values: differences of about ``scale``, a few exact zeros."""
    rng = random.Random(candidate)
    report = PairReport("hf", candidate, "float32", tolerance_for("float32", across_backends=True))
    report.rows = 20
    report.trace.teacher_forced = [
        (k % 16, 0.0 if k % 9 == 0 else rng.gauss(0, scale)) for k in range(400)
    ]
    for name in ("hf", candidate):
        report.trace.processed[name] = [(k % 16, rng.gauss(0, scale)) for k in range(80)]
        report.processed[name] = LogprobError()
    report.top_k.statuses = [(k % 16, "same") for k in range(150)] + [
        (3, "edge tie"),
        (9, "differ"),
    ]
    expected = [0.0] * 64
    for token, p in enumerate([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05], start=3):
        expected[token] = p
    tokens = rng.choices(range(64), weights=expected, k=300)
    report.trace.sampling = [
        SamplingTrace(
            expected, {"hf": tokens, candidate: tokens[::-1]}, {"hf": 0.5, candidate: 0.4}
        )
    ]
    report.failures = failures
    return report


def test_every_pair_gets_four_pictures_and_a_section(tmp_path: Path):
    reports = [
        _report("vllm", 3e-6, []),
        _report("sglang", 4e-5, ["teacher-forced logprobs differ by 4.1e-05 > 2e-05"]),
    ]
    page = write_plots(reports, tmp_path / "plots")
    html = page.read_text()
    for report in reports:
        stem = f"hf-vs-{report.candidate}-float32"
        for kind in ("differences", "positions", "top-k", "sampling"):
            picture = tmp_path / "plots" / f"{stem}-{kind}.png"
            assert picture.read_bytes()[:8] == _PNG, f"{picture.name} is not a PNG"
            assert picture.stat().st_size > 10_000, f"{picture.name} looks empty"
            assert f'src="{picture.name}"' in html
    assert html.count('class="pass"') == 1 and html.count('class="fail"') == 1
    assert "teacher-forced logprobs differ by 4.1e-05" in html


def test_a_pair_without_sampling_has_no_sampling_picture(tmp_path: Path):
    report = _report("vllm", 3e-6, [])
    report.trace.sampling = []
    write_plots([report], tmp_path)
    assert not list(tmp_path.glob("*-sampling.png"))
    assert len(list(tmp_path.glob("*.png"))) == 3
