"""A suite that cannot fail proves nothing: run it against one broken backend per property."""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from faulty_ngram import FAULTS  # noqa: E402

_HEADER = """
import pytest
from faulty_ngram import FAULTS
from gen_testkit.conformance import (
    ConformanceSubject, GenerationConformanceSuite, conformance_config,
)

def _subject(fault):
    backend_cls, mode, _ = FAULTS[fault]
    config = conformance_config(
        backend="ngram", model_name="ngram", vocab_size=512, logprobs_mode=mode
    )
    backend = backend_cls(config)
    return ConformanceSubject(backend, 512, backend.state_dict())
"""

_CLASS = """
class TestFault{index}(GenerationConformanceSuite):
    claims_weight_updates = True
    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield _subject({fault!r})
"""


def test_every_fault_fails_the_tests_that_guard_against_it(pytester):
    faults = sorted(FAULTS)
    pytester.makepyfile(
        test_faults=_HEADER + "".join(_CLASS.format(index=i, fault=f) for i, f in enumerate(faults))
    )
    selection = " or ".join(
        f"(TestFault{i} and {name})" for i, fault in enumerate(faults) for name in FAULTS[fault][2]
    )
    junit = pytester.path / "report.xml"
    pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-k",
        selection,
        f"--junitxml={junit}",
        f"--rootdir={pytester.path}",
        "-o",
        f"pythonpath={HERE}",
    )
    failed: dict[str, set[str]] = {}
    passed: dict[str, set[str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        index = int(case.get("classname").rsplit("TestFault", 1)[1])
        name = case.get("name").split("[")[0]
        bucket = (
            failed if case.find("failure") is not None or case.find("error") is not None else passed
        )
        bucket.setdefault(faults[index], set()).add(name)
    escaped = {
        fault: sorted(FAULTS[fault][2] - failed.get(fault, set()))
        for fault in faults
        if FAULTS[fault][2] - failed.get(fault, set())
    }
    assert not escaped, f"faults the conformance suite did not catch: {escaped}"
