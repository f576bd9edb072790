"""``tools/bench/quiet.py``: the wait before a timed run ends once the machine is quiet, and
never later than its bound. (Thresholds at the ends of the scale keep the checks independent of
what else the machine runs.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

from quiet import wait_until_quiet


def test_a_quiet_machine_is_waited_for_one_window_and_no_more(capsys: pytest.CaptureFixture[str]):
    start = time.monotonic()
    waited = wait_until_quiet(busy_below=1.01, window_s=0.1, at_most_s=5.0)  # any load is quiet
    assert 0.1 <= waited < 1.0
    assert waited <= time.monotonic() - start
    assert capsys.readouterr().out == ""


def test_a_machine_that_never_goes_quiet_is_waited_for_the_bound_and_said_so(
    capsys: pytest.CaptureFixture[str],
):
    waited = wait_until_quiet(busy_below=0.0, window_s=0.1, at_most_s=0.35)  # no load is quiet
    assert 0.35 <= waited < 2.0
    said = capsys.readouterr().out
    assert "stayed busy" in said
    assert "shares it" in said
