"""The CONTRACT as a test base class that every backend's test file subclasses.

Usage, in a backend's tests::

    class TestMyBackend(GenerationConformanceSuite):
        claims_score = True

        @pytest.fixture(scope="class")
        @classmethod
        def subject(cls, tiny_qwen2):
            config = conformance_config(backend="mine", model_name=str(tiny_qwen2.path),
                                        vocab_size=tiny_qwen2.vocab_size)
            backend = MyBackend(config)
            yield ConformanceSubject.for_model(backend, tiny_qwen2)
            backend.shutdown()

The subject's backend must be built from ``conformance_config`` (other keys may be added): the
properties rely on its short generations and its many stop tokens. Capability flags
(``claims_*``) turn on the tests of optional capabilities; a capability not claimed must raise
``NotImplementedError``. Override a test only with a reason in its docstring.
"""

from gen_testkit.suite.base import ConformanceSubject, conformance_config
from gen_testkit.suite.capabilities import CapabilityProperties
from gen_testkit.suite.deltas import WeightDeltaProperties
from gen_testkit.suite.determinism import DeterminismProperties
from gen_testkit.suite.layout import LayoutProperties
from gen_testkit.suite.lifecycle import LifecycleProperties
from gen_testkit.suite.metrics import MetricsProperties
from gen_testkit.suite.row_sampling import RowSamplingProperties
from gen_testkit.suite.text import TextProperties

__all__ = ["ConformanceSubject", "GenerationConformanceSuite", "conformance_config"]


class GenerationConformanceSuite(
    LayoutProperties,
    DeterminismProperties,
    RowSamplingProperties,
    LifecycleProperties,
    CapabilityProperties,
    TextProperties,
    MetricsProperties,
    WeightDeltaProperties,
):
    """The CONTRACT's generation rules, as tests a backend's test class inherits.

    Subclasses provide the class-scoped ``subject`` fixture and set the flags of ``SuiteBase``
    (``claims_score``, ``claims_weight_updates``, ``claims_weight_deltas``).
    """
