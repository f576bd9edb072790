"""Cross-backend parity: compare any two backends on the same model and inputs.

``run_pair`` measures greedy agreement (near-ties apart), teacher-forced logprob error on each
other's outputs, processed logprobs against the exact distribution, and a goodness-of-fit test of
sampled tokens; ``gen-parity`` (``cli.main``) runs every installed backend pair and prints a table.
"""

from gen_testkit.parity.metrics import GreedyAgreement, LogprobError, SamplingFit, chi_square_fit
from gen_testkit.parity.oracle import HfLogitsOracle, LogitsOracle, NgramLogitsOracle
from gen_testkit.parity.runner import SIGNIFICANCE, PairReport, TimedBackend, run_pair
from gen_testkit.parity.workload import PARITY_SETTINGS, parity_batches, sampling_plan

__all__ = [
    "PARITY_SETTINGS",
    "SIGNIFICANCE",
    "GreedyAgreement",
    "HfLogitsOracle",
    "LogitsOracle",
    "LogprobError",
    "NgramLogitsOracle",
    "PairReport",
    "SamplingFit",
    "TimedBackend",
    "chi_square_fit",
    "parity_batches",
    "run_pair",
    "sampling_plan",
]
