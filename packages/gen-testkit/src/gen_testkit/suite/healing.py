"""Healing: a backend whose replicas are a fleet loses one, and nobody can tell but its metrics.

For backends that heal (gen-vllm's ``Fleet``, the testkit's ``NgramFleet``): the health of their
replicas is the kit's ``FleetHealth``, read here through ``get_logger_metrics()``:
``fleet_size``, ``fleet_replicas_serving``, ``fleet_epoch``, ``fleet_rows_rerun_total``, and
per replica ``replica_<i>_state`` (``ReplicaState``: 0 serving) and
``replica_<i>_weight_version`` (-1: unverified). Properties:

(a) a call during which a replica is lost returns exactly what the same call without the fault
    returns: tokens, logprobs (within the suite's tolerance) and every token's weight version;
(b) once healed, every replica serves at the fleet's weight version, and the next refit reaches
    every one of them (every row carries the new version and comes from the new weights);
(c) a replacement is admitted (serving) only at the fleet's version, and only holding the
    fleet's weights: rows it serves equal the rows served before the loss;
(d) after a refit no replica serves older weights: no row carries an older version, and a
    prompt gives the same row on every replica.

Copies of one prompt side by side (``fleet_size`` of each) are how the checks reach every
replica: a backend spreading a call's rows over its replicas puts neighbours on different ones.

Not part of ``GenerationConformanceSuite``. Subclass it once per healing backend with two
class-scoped fixtures: ``subject`` (a ``ConformanceSubject`` whose ``state_dict`` is set) and
``replica_faults`` (a ``ReplicaFaults``: the fault-injection hook). Each test leaves the backend
healed, on the subject's own weights. Every loss costs a replacement, so the hypothesis
properties draw few examples, at most ``HEALING_MAX_EXAMPLES`` whatever the profile (the
``nightly`` profile's tenth of 500 would cost 50-150 replacements); ``heal_timeout_s`` bounds
each healing. A class costs at most ``RESTARTS_NEEDED`` replacements: give the subject's fleet at
least that many (a fleet past its restarts runs smaller and never heals, which the checks report
before a loss rather than waiting ``heal_timeout_s`` for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import pytest
import torch
from gen_interface import BatchedDataDict, GenerationInterface
from gen_interface.weights import refit
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gen_testkit.compare import compare_generations
from gen_testkit.strategies import generation_batches, pad_prompts, prompts
from gen_testkit.suite.base import ConformanceSubject, property_settings
from gen_testkit.suite.in_thread import InThread
from gen_testkit.tolerances import tolerance_for

__all__ = ["HealingChecks", "ReplicaFaults"]

SERVING = 0  # ReplicaState.SERVING as the metrics report it

#: Few examples, and no shrinking: each example loses a replica and waits for its replacement
#: (a failure is reported as drawn).
#: The most examples a healing property draws, whatever the profile.
HEALING_MAX_EXAMPLES = 10
#: Replacements one class of the checks may cost: up to three losses per example of (a), and a
#: few for the other checks.
RESTARTS_NEEDED = 3 * HEALING_MAX_EXAMPLES + 10

healing_settings = settings(
    property_settings,
    max_examples=min(HEALING_MAX_EXAMPLES, max(2, settings().max_examples // 10)),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)


@runtime_checkable
class ReplicaFaults(Protocol):
    """The fault-injection hook a healing backend's test class provides (fixture
    ``replica_faults``). Replicas are numbered as in the metrics (``replica_<i>_state``)."""

    def holds_rows(self, replica: int) -> bool:
        """Whether ``replica`` runs rows of a call now (some not finished)."""
        ...

    def lose_replica(self, replica: int) -> None:
        """Make ``replica`` fail now, as a crashed worker would (its process killed, its engine
        gone), and return at once. Noticing it, moving its rows and replacing it are the
        backend's business."""
        ...


class HealingChecks:
    """A lost replica costs a re-run and a replacement, never a wrong or stale row."""

    #: New tokens per row where a loss must land while rows run.
    long_tokens: ClassVar[int] = 32
    #: The longest a loss may take to be noticed and its replacement admitted.
    heal_timeout_s: ClassVar[float] = 240.0

    @pytest.fixture(scope="class")
    @classmethod
    def replica_faults(cls) -> ReplicaFaults:
        """Override in the subclass: the hook that loses a replica of the subject's backend."""
        raise NotImplementedError(f"{cls.__name__} must override the replica_faults fixture")

    def _fleet(self, subject: ConformanceSubject, faults: ReplicaFaults) -> _Fleet:
        return _Fleet(subject, faults, self.heal_timeout_s)

    # ---- (a) -------------------------------------------------------------------------------

    @healing_settings
    @given(data=st.data())
    def test_a_call_that_loses_a_replica_returns_what_the_call_without_the_fault_returns(
        self, subject: ConformanceSubject, replica_faults: ReplicaFaults, data: st.DataObject
    ) -> None:
        """Sampled rows with drawn seeds, at least two per replica; a drawn replica is lost while
        it runs some: every row equals the fault-free call's, token versions included."""
        size = self._fleet(subject, replica_faults).size
        drawn = data.draw(
            generation_batches(
                subject.vocab_size,
                min_rows=2 * size,
                max_rows=3 * size,
                max_length=8,
                pad_token_id=subject.backend.config["pad_token_id"],
            ),
            label="batch",
        )
        rows = len(drawn.prompts)
        seeds = data.draw(
            st.lists(st.integers(0, 2**63 - 1), min_size=rows, max_size=rows), label="seeds"
        )
        victim = data.draw(st.integers(0, size - 1), label="victim")
        batch = drawn.data
        batch["sample_seeds"] = torch.tensor(seeds, dtype=torch.int64)
        long = _long_rows(subject.backend, self.long_tokens)
        expected = long.generate(batch)
        with self._fleet(subject, replica_faults) as fleet:
            out = fleet.generate_losing(lambda: long.generate(batch), victim)
        _assert_same(subject, expected, out, "a call that lost a replica and the fault-free call")
        assert _token_versions(out) == _token_versions(expected), "token weight versions differ"

    # ---- (b) -------------------------------------------------------------------------------

    def test_a_healed_fleet_serves_at_the_fleet_version_and_the_next_refit_reaches_every_replica(
        self, subject: ConformanceSubject, replica_faults: ReplicaFaults
    ) -> None:
        with self._fleet(subject, replica_faults) as fleet:
            fleet.lose_and_heal(fleet.size - 1)
            fleet.assert_every_replica_at(subject.backend.weight_version)
            before = fleet.probe()
            version = fleet.refit_new(seed=11)
            fleet.assert_every_replica_at(version)
            after = fleet.probe()
        assert set(_all_versions(after)) == {version}, "a row ran on weights before the refit"
        for i, (old, new) in enumerate(zip(_generated(before), _generated(after))):
            assert old != new, f"row {i} is the same before and after the refit: not refitted"

    # ---- (c) -------------------------------------------------------------------------------

    def test_a_replacement_serves_only_at_the_fleet_version_and_with_the_fleet_s_weights(
        self, subject: ConformanceSubject, replica_faults: ReplicaFaults
    ) -> None:
        """After a refit (so the checkpoint is not the fleet's weights), a replica is lost; while
        it heals, the replica is never seen serving at another version, and once admitted the
        replacement's rows are those the fleet served before the loss."""
        victim = 0
        with self._fleet(subject, replica_faults) as fleet:
            version = fleet.refit_new(seed=12)
            expected = fleet.probe()
            seen = fleet.lose_and_heal(victim)
            fleet.assert_every_replica_at(version)
            healed = fleet.probe()
        wrong = [(state, v) for state, v in seen[victim] if state == SERVING and v != version]
        assert not wrong, f"replica {victim} served at versions {wrong} (fleet: {version})"
        _assert_same(subject, expected, healed, "rows before the loss and after healing")

    # ---- (d) -------------------------------------------------------------------------------

    @healing_settings
    @given(data=st.data())
    def test_after_a_refit_no_replica_serves_an_older_version(
        self, subject: ConformanceSubject, replica_faults: ReplicaFaults, data: st.DataObject
    ) -> None:
        drawn = data.draw(prompts(subject.vocab_size, max_rows=3, max_length=8), label="prompts")
        seed = data.draw(st.integers(0, 2**31 - 1), label="weights seed")
        with self._fleet(subject, replica_faults) as fleet:
            version = fleet.refit_new(seed=seed)
            out = fleet.probe(drawn)
            fleet.assert_every_replica_at(version)
        stale = sorted(set(_all_versions(out)) - {version})
        assert not stale, f"rows carry versions {stale} after the refit to version {version}"


class _Fleet:
    """The subject's fleet as the checks see it: metrics, losses, refits, probes. As a context
    manager: healed on entry; on exit healed again and on the subject's own weights (refitted
    under a new version when others were refitted)."""

    def __init__(self, subject: ConformanceSubject, faults: ReplicaFaults, timeout_s: float):
        assert subject.state_dict is not None, "the subject needs its state_dict"
        assert isinstance(faults, ReplicaFaults), f"replica_faults is no ReplicaFaults: {faults!r}"
        self.subject = subject
        self.backend = subject.backend
        self.faults = faults
        self.timeout_s = timeout_s
        self.refitted = False
        metrics = self.metrics()
        missing = [
            k for k in ("fleet_size", "fleet_epoch", "fleet_rows_rerun_total") if k not in metrics
        ]
        assert not missing, f"the backend reports no {missing} metrics: does it heal?"
        self.size = int(metrics["fleet_size"])

    def __enter__(self) -> _Fleet:
        self.wait_healed()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait_healed()
        if self.refitted and self.subject.state_dict is not None:
            refit(self.backend, self.subject.state_dict)

    def metrics(self) -> dict[str, int | float]:
        return self.backend.get_logger_metrics()

    def states(self, metrics: Mapping[str, int | float]) -> list[tuple[int, int]]:
        """Each replica's ``(state, weight version)``."""
        return [
            (int(metrics[f"replica_{i}_state"]), int(metrics[f"replica_{i}_weight_version"]))
            for i in range(self.size)
        ]

    def wait_healed(self, epoch_at_least: int = 0) -> list[list[tuple[int, int]]]:
        """Until every replica serves (and the epoch reached ``epoch_at_least``); returns each
        replica's ``(state, version)`` as seen at every look meanwhile."""
        seen: list[list[tuple[int, int]]] = [[] for _ in range(self.size)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            metrics = self.metrics()
            for i, state in enumerate(self.states(metrics)):
                seen[i].append(state)
            healed = metrics["fleet_replicas_serving"] == self.size
            if healed and metrics["fleet_epoch"] >= epoch_at_least:
                return seen
            assert time.monotonic() < deadline, (
                f"the fleet did not heal within {self.timeout_s} s: "
                f"{self.states(metrics)} ((state, version) per replica)"
            )
            time.sleep(0.005)

    def lose_and_heal(self, replica: int) -> list[list[tuple[int, int]]]:
        """Lose ``replica`` while idle and wait until its replacement serves (its leaving and
        its admission each count one epoch); returns what ``wait_healed`` saw."""
        epoch = int(self._restart_left()["fleet_epoch"])
        self.faults.lose_replica(replica)
        return self.wait_healed(epoch + 2)

    def _restart_left(self) -> dict[str, int | float]:
        """The metrics, once sure a loss now will be replaced."""
        metrics = self.metrics()
        left = metrics.get("fleet_restarts_left")
        assert left is None or left >= 1, (
            "the subject's fleet has no restarts left, so a replica lost now is never replaced "
            f"and the fleet cannot heal: give it at least RESTARTS_NEEDED ({RESTARTS_NEEDED}) "
            "restarts"
        )
        return metrics

    def generate_losing(
        self, generate: Callable[[], BatchedDataDict[Any]], victim: int
    ) -> BatchedDataDict[Any]:
        """``generate()`` on a thread, ``victim`` lost once it holds rows; the fleet is healed
        again before this returns. Tried up to three times until the loss landed while the
        victim held unfinished rows (``fleet_rows_rerun_total`` grew)."""
        for _ in range(3):
            before = self._restart_left()
            call = InThread(generate)
            deadline = time.monotonic() + self.timeout_s
            while not self.faults.holds_rows(victim) and not call.done.is_set():
                assert time.monotonic() < deadline, f"replica {victim} never held rows"
                time.sleep(0.001)
            self.faults.lose_replica(victim)
            out = call.result(self.timeout_s)
            self.wait_healed(int(before["fleet_epoch"]) + 2)
            if self.metrics()["fleet_rows_rerun_total"] > before["fleet_rows_rerun_total"]:
                return out
        raise AssertionError(
            f"in three calls the loss of replica {victim} never landed while it held "
            "unfinished rows (fleet_rows_rerun_total did not grow): rows too short here? "
            "raise long_tokens"
        )

    def refit_new(self, seed: int) -> int:
        """Refit weights clearly different from the subject's (drawn from ``seed``); the
        version."""
        assert self.subject.state_dict is not None
        generator = torch.Generator().manual_seed(seed)
        new = {
            name: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=generator)
            for name, t in self.subject.state_dict.items()
        }
        self.refitted = True
        return refit(self.backend, new)

    def probe(self, rows: list[list[int]] | None = None) -> BatchedDataDict[Any]:
        """Greedy rows of ``rows`` (default: a fixed prompt), each ``size`` times side by side;
        the copies of a prompt must agree (every replica holds the same weights)."""
        rows = rows or [[5, 17, 42, 8]]
        copies = [row for row in rows for _ in range(self.size)]
        pad = self.backend.config["pad_token_id"]
        view = self.backend.with_sampling(max_new_tokens=8, stop_token_ids=[])
        out = view.generate(pad_prompts(copies, "left", pad_token_id=pad), greedy=True)
        for k in range(len(rows)):
            first = out.select_indices([k * self.size] * self.size)
            each = out.select_indices(list(range(k * self.size, (k + 1) * self.size)))
            _assert_same(self.subject, first, each, f"the {self.size} copies of prompt {k}")
        return out

    def assert_every_replica_at(self, version: int) -> None:
        states = self.states(self.metrics())
        assert states == [(SERVING, version)] * self.size, (
            f"(state, weight version) per replica: {states}; expected all serving at {version}"
        )


def _long_rows(backend: GenerationInterface, tokens: int) -> GenerationInterface:
    return backend.with_sampling(max_new_tokens=tokens, stop_token_ids=[])


def _generated(out: Mapping[str, Any], key: str = "logprobs") -> list[list[float]]:
    """Each row's generated positions of ``out[key]``."""
    rows = []
    for i in range(out["output_ids"].shape[0]):
        end = int(out["unpadded_sequence_lengths"][i])
        start = end - int(out["generation_lengths"][i])
        rows.append(out[key][i, start:end].tolist())
    return rows


def _token_versions(out: Mapping[str, Any]) -> list[list[int]]:
    return [[int(v) for v in row] for row in _generated(out, "weight_versions")]


def _all_versions(out: Mapping[str, Any]) -> list[int]:
    return [v for row in _token_versions(out) for v in row]


def _assert_same(subject: ConformanceSubject, expected: Any, actual: Any, what: str) -> None:
    config = subject.backend.config
    tolerance = tolerance_for(config.get("dtype", "float32"), across_backends=False)
    processed = config.get("logprobs_mode") == "processed"
    atol = tolerance.processed_logprob_atol if processed else tolerance.logprob_atol
    compare_generations(expected, actual, logprob_atol=atol, near_tie=tolerance.near_tie).assert_ok(
        what
    )
