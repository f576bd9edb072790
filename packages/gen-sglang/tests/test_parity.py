"""``gen-parity --backends hf,sglang``: the ``hf vs sglang`` row passes at the float32
tolerances (greedy, teacher-forced, processed logprobs, chi-square of sampled tokens)."""

from __future__ import annotations

import pytest
from gen_testkit.parity.cli import main


def test_gen_parity_passes_for_hf_vs_sglang(capsys: pytest.CaptureFixture[str]):
    code = main(["--backends", "hf,sglang", "--samples", "300"])
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| hf vs sglang |"))
    assert row.rstrip().endswith("| PASS |"), printed
    assert code == 0
