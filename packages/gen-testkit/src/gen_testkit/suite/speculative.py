"""Speculative decoding is lossless: what a speculating backend returns is what it would without.

For backends that offer ``speculative`` (``SpeculativeConfig``). A test class inherits
``SpeculativeProperties`` and provides three class-scoped fixtures:

- ``subject``: the speculating backend, built from ``conformance_config`` plus ``speculative``;
- ``plain_subject``: the same model and config without ``speculative``;
- ``logits_oracle``: a ``LogitsOracle`` of the target (the policy) model.

The properties, each of which a backend that takes a drafter's word for the target's breaks:

- greedy rows equal the same call without speculation (the near-tie rule applies, as between
  any two engines: a verifying pass batches positions differently);
- every reported logprob and top logprob is the target's, raw or processed as configured;
- sampled tokens follow the target's processed distribution at every position, not only the
  first (a randomised probability-integral transform per position, chi-square against uniform);
- a seed makes a speculated row reproducible (it need not equal the seed's row without
  speculation: acceptance draws from the same stream);
- the ``speculative_*`` metrics add up (``gen_backend_kit.speculation``).

With ``claims_batch_schedule``, ``scheduled_subject`` is the subject built with the batch
schedule ``one_row_only(k)`` (``num_speculative_tokens_per_batch_size``: drafts at batch size
1, none above): a call of several rows proposes no draft and a one-row call does, both giving
the greedy rows of plain decoding.

With ``claims_drafter_refit``, the drafter's weights are a refit group of their own
(``drafter_weights``: its tensors by the names an update carries them under): a refit of the
drafter alone changes acceptance and never the target's outputs, reports the drafter's version,
and a damaged or partial drafter update is refused with nothing changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch
from gen_backend_kit.sampling import processed_log_probs
from gen_interface import BatchedDataDict, WeightUpdateError
from gen_interface.weights import refit
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from gen_testkit.compare import generated_rows
from gen_testkit.parity.oracle import LogitsOracle
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings
from gen_testkit.tolerances import tolerance_for

__all__ = ["SpeculativeProperties", "one_row_only"]


def one_row_only(k: int) -> list[list[int]]:
    """The batch schedule of ``scheduled_subject`` for ``num_speculative_tokens`` ``k``: ``k``
    drafts at batch size 1, none from 2 rows up."""
    return [[1, 1, k], [2, 1 << 20, 0]]


#: Chance that an honest backend fails the distribution check (split over its positions).
SIGNIFICANCE = 1e-3
#: Bins of the probability-integral-transform histogram per position.
_BINS = 10


class SpeculativeProperties(SuiteBase):
    """Lossless speculative decoding; see the module docstring."""

    #: Rows of one prompt sampled for the distribution check.
    distribution_rows: ClassVar[int] = 200
    #: The drafter's weights are a refit group (``drafter_weights``).
    claims_drafter_refit: ClassVar[bool] = False
    #: The backend honours ``num_speculative_tokens_per_batch_size`` (``scheduled_subject``).
    claims_batch_schedule: ClassVar[bool] = False

    @pytest.fixture(scope="class")
    @classmethod
    def plain_subject(cls) -> ConformanceSubject:
        """Override: the subject's model and config without ``speculative``."""
        raise NotImplementedError(f"{cls.__name__} must override plain_subject")

    @pytest.fixture(scope="class")
    @classmethod
    def logits_oracle(cls) -> LogitsOracle:
        """Override: the target model's exact logits."""
        raise NotImplementedError(f"{cls.__name__} must override logits_oracle")

    @pytest.fixture(scope="class")
    @classmethod
    def drafter_weights(cls) -> Mapping[str, torch.Tensor] | None:
        """Override with ``claims_drafter_refit``: the drafter's tensors, by update name."""
        return None

    @pytest.fixture(scope="class")
    @classmethod
    def scheduled_subject(cls) -> ConformanceSubject | None:
        """Override with ``claims_batch_schedule``: the subject's model and speculative section
        with ``num_speculative_tokens_per_batch_size`` ``one_row_only(k)``."""
        return None

    def test_the_subject_speculates_and_the_plain_one_does_not(
        self, subject: ConformanceSubject, plain_subject: ConformanceSubject
    ):
        section = subject.backend.config.get("speculative")
        assert section, "the subject must be built with a speculative section"
        assert section["method"] in subject.backend.capabilities.speculative
        assert not plain_subject.backend.config.get("speculative")
        assert plain_subject.backend.config["model_name"] == subject.backend.config["model_name"]

    @property_settings
    @given(data=st.data())
    def test_greedy_rows_equal_the_same_call_without_speculation(
        self, subject: ConformanceSubject, plain_subject: ConformanceSubject, data
    ):
        batch = self._draw(data, subject).data
        expected = plain_subject.backend.generate(batch, greedy=True)
        actual = subject.backend.generate(batch, greedy=True)
        self._assert_same(subject, expected, actual, "greedy with speculation vs without")

    def test_a_stop_token_inside_an_accepted_run_ends_the_row_there(
        self, subject: ConformanceSubject, plain_subject: ConformanceSubject
    ):
        """A verifying step emits several tokens; a stop token among them is the row's last."""
        batch = self._fixed_batch(subject)
        free = plain_subject.backend.with_sampling(stop_token_ids=[], max_new_tokens=8)
        tokens = [t for t, _ in generated_rows(free.generate(batch, greedy=True))]
        stop = next(row[j] for row in tokens for j in range(2, len(row)) if row[j] not in row[:j])
        expected = plain_subject.backend.with_sampling(stop_token_ids=[stop]).generate(
            batch, greedy=True
        )
        actual = subject.backend.with_sampling(stop_token_ids=[stop]).generate(batch, greedy=True)
        self._assert_same(subject, expected, actual, f"greedy with stop token {stop}")
        for row, _ in generated_rows(actual):
            assert stop not in row[:-1], f"a row went on past its stop token {stop}: {row}"

    @property_settings
    @given(data=st.data(), top_logprobs=st.integers(0, 3))
    def test_reported_logprobs_are_the_targets(
        self,
        subject: ConformanceSubject,
        logits_oracle: LogitsOracle,
        data,
        top_logprobs: int,
    ):
        drawn = self._draw(data, subject)
        backend = subject.backend.with_sampling(top_logprobs=top_logprobs)
        out = backend.generate(drawn.data)
        config = backend.config
        processed = config.get("logprobs_mode") == "processed"
        tolerance = tolerance_for(config.get("dtype", "float32"), across_backends=True)
        atol = tolerance.processed_logprob_atol if processed else tolerance.logprob_atol
        for i, (prompt, (tokens, logprobs)) in enumerate(zip(drawn.prompts, generated_rows(out))):
            if not tokens:
                continue
            expected = self._target_log_probs(logits_oracle, prompt, tokens, config, processed)
            picked = expected.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(logprobs), picked, atol=atol), (
                f"row {i}: reported logprobs {logprobs} are not the target's {picked.tolist()}"
            )
            if top_logprobs:
                got = _row_top_logprobs(out, i, len(tokens))
                want = expected.topk(top_logprobs, dim=-1).values
                assert torch.allclose(got, want, atol=atol), (
                    f"row {i}: top logprobs {got.tolist()} are not the target's {want.tolist()}"
                )

    def test_sampled_tokens_follow_the_target_at_every_position(
        self, subject: ConformanceSubject, logits_oracle: LogitsOracle
    ):
        prompt = self._fixed_batch(subject)["input_ids"][0]
        prompt = prompt[prompt != subject.backend.config["pad_token_id"]].tolist()
        n = self.distribution_rows
        backend = subject.backend.with_sampling(stop_token_ids=[], seed=20261206)
        out = backend.generate(pad_prompts([prompt] * n, "left", pad_token_id=0))
        config = backend.config
        uniform = torch.Generator().manual_seed(0)
        by_position: dict[int, list[float]] = {}
        for tokens, _ in generated_rows(out):
            probs = self._target_log_probs(logits_oracle, prompt, tokens, config, True).exp()
            for j, token in enumerate(tokens):
                by_position.setdefault(j, []).append(
                    _randomised_pit(probs[j], token, float(torch.rand((), generator=uniform)))
                )
        assert len(by_position) >= 4, f"rows too short to test positions: {len(by_position)}"
        bound = SIGNIFICANCE / len(by_position)
        for j, values in sorted(by_position.items()):
            observed = torch.histc(torch.tensor(values), bins=_BINS, min=0.0, max=1.0)
            p_value = float(stats.chisquare(observed.numpy()).pvalue)
            assert p_value >= bound, (
                f"position {j}: sampled tokens do not follow the target's distribution "
                f"(chi-square p = {p_value:.2g} < {bound:.2g}, {len(values)} rows; "
                f"PIT histogram {observed.int().tolist()})"
            )

    def test_a_seed_makes_a_speculated_row_reproducible(self, subject: ConformanceSubject):
        batch = self._fixed_batch(subject)
        first = subject.backend.generate(batch)
        again = subject.backend.generate(batch)
        assert torch.equal(first["output_ids"], again["output_ids"])
        assert torch.equal(first["logprobs"], again["logprobs"])

    def test_speculation_metrics_add_up(self, subject: ConformanceSubject):
        backend, batch = subject.backend, self._fixed_batch(subject)
        section = backend.config.get("speculative")
        assert section, "the subject must be built with a speculative section"
        k = section["num_speculative_tokens"]
        backend.clear_logger_metrics()
        out = backend.generate(batch, greedy=True)
        m = backend.get_logger_metrics()
        drafts = m["speculative_drafts_total"]
        proposed = m["speculative_proposed_tokens_total"]
        accepted = m["speculative_accepted_tokens_total"]
        tokens = int(out["generation_lengths"].sum())
        assert drafts > 0 and 0 <= accepted <= proposed <= k * drafts, m
        # a verifying step emits at most its accepted tokens and one more; a row's first
        # token may come from the prompt's pass, before any draft
        assert tokens <= drafts + accepted + batch.size, (tokens, m)
        assert m["speculative_acceptance_rate"] == pytest.approx(accepted / proposed)
        assert m["speculative_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
        backend.clear_logger_metrics()
        cleared = backend.get_logger_metrics()
        assert cleared["speculative_drafts_total"] == cleared["speculative_proposed_tokens_total"]
        assert cleared["speculative_proposed_tokens_total"] == 0

    def test_the_batch_schedule_stops_drafts_where_it_gives_none(
        self,
        scheduled_subject: ConformanceSubject | None,
        plain_subject: ConformanceSubject,
    ):
        """Several rows in flight: no draft (the schedule's 0); one row: drafts. Each call's
        rows all run to ``max_new_tokens`` together, so the batch never shrinks within it."""
        if not self.claims_batch_schedule:
            pytest.skip("backend does not claim num_speculative_tokens_per_batch_size")
        assert scheduled_subject is not None
        section = scheduled_subject.backend.config.get("speculative")
        assert section, "scheduled_subject must be built with a speculative section"
        k = section["num_speculative_tokens"]
        assert section.get("num_speculative_tokens_per_batch_size") == one_row_only(k)
        settings = {"stop_token_ids": [], "max_new_tokens": 12}
        backend = scheduled_subject.backend.with_sampling(**settings)
        plain = plain_subject.backend.with_sampling(**settings)
        batch = self._fixed_batch(scheduled_subject)
        for rows, drafting in ((batch, False), (batch.slice(0, 1), True)):
            backend.clear_logger_metrics()
            actual = backend.generate(rows, greedy=True)
            m = scheduled_subject.backend.get_logger_metrics()
            what = f"{rows.size} row(s) under batch schedule {one_row_only(k)}"
            if drafting:
                assert m["speculative_proposed_tokens_total"] > 0, (what, m)
            else:
                assert m["speculative_drafts_total"] == 0, (what, m)
                assert m["speculative_proposed_tokens_total"] == 0, (what, m)
            expected = plain.generate(rows, greedy=True)
            self._assert_same(scheduled_subject, expected, actual, f"greedy, {what}")

    # ---- the drafter refits in the policy's transaction --------------------------------

    def test_a_drafter_refit_changes_acceptance_and_never_the_outputs(
        self,
        subject: ConformanceSubject,
        plain_subject: ConformanceSubject,
        drafter_weights: Mapping[str, torch.Tensor] | None,
    ):
        if not self.claims_drafter_refit:
            pytest.skip("backend does not claim drafter refits")
        assert drafter_weights is not None
        backend, batch = subject.backend, self._fixed_batch(subject)
        expected = plain_subject.backend.generate(batch, greedy=True)

        def acceptance() -> float:
            backend.clear_logger_metrics()
            self._assert_same(
                subject, expected, backend.generate(batch, greedy=True), "after a drafter refit"
            )
            return backend.get_logger_metrics()["speculative_acceptance_rate"]

        trained = acceptance()
        noise = torch.Generator().manual_seed(7)
        scrambled = {
            name: w[torch.randperm(w.shape[0], generator=noise)] if w.dim() else w
            for name, w in drafter_weights.items()
        }
        version = refit(backend, scrambled)
        assert backend.get_logger_metrics()["speculative_drafter_weight_version"] == version
        worse = acceptance()
        assert worse < trained, f"a scrambled drafter kept acceptance {worse} >= {trained}"
        version = refit(backend, dict(drafter_weights))
        assert backend.get_logger_metrics()["speculative_drafter_weight_version"] == version
        assert acceptance() == pytest.approx(trained)

    def test_a_damaged_or_partial_drafter_update_is_refused_and_changes_nothing(
        self, subject: ConformanceSubject, drafter_weights: Mapping[str, torch.Tensor] | None
    ):
        if not self.claims_drafter_refit:
            pytest.skip("backend does not claim drafter refits")
        assert drafter_weights is not None
        backend, batch = subject.backend, self._fixed_batch(subject)
        before = backend.generate(batch, greedy=True)
        version = backend.get_logger_metrics()["speculative_drafter_weight_version"]
        name = next(iter(drafter_weights))
        damaged = {**drafter_weights, name: drafter_weights[name].flatten()[:-1]}
        partial = dict(list(drafter_weights.items())[1:])
        for what, update in (("damaged", damaged), ("partial", partial)):
            with pytest.raises(WeightUpdateError):
                refit(backend, update)
            after = backend.generate(batch, greedy=True)
            assert torch.equal(before["output_ids"], after["output_ids"]), what
            metrics = backend.get_logger_metrics()
            assert metrics["speculative_drafter_weight_version"] == version, what

    # ---- helpers -------------------------------------------------------------------------

    @staticmethod
    def _target_log_probs(
        oracle: LogitsOracle,
        prompt: list[int],
        tokens: list[int],
        config: Mapping[str, Any],
        processed: bool,
    ) -> torch.Tensor:
        """``[G, V]``: the target's log-probabilities at each of the G generated positions, raw
        or processed with the config's sampling settings."""
        logits = oracle.sequence_logits([*prompt, *tokens])[len(prompt) - 1 : -1].float()
        if not processed:
            return logits.log_softmax(-1)
        return processed_log_probs(
            logits,
            float(config["temperature"]),
            config.get("top_k"),
            float(config.get("top_p", 1.0)),
            float(config.get("min_p", 0.0)),
        )


def _randomised_pit(probs: torch.Tensor, token: int, u: float) -> float:
    """``F(x-) + u p(x)``, tokens ordered from the likeliest: uniform on [0, 1] when ``token``
    is drawn from ``probs`` ``[V]`` and ``u`` from U(0, 1), whatever the distribution."""
    order = torch.sort(probs, descending=True, stable=True).indices
    rank = int((order == token).nonzero()[0, 0])
    before = float(probs[order[:rank]].sum())
    return min(before + u * float(probs[token]), 1.0)


def _row_top_logprobs(out: BatchedDataDict[Any], row: int, count: int) -> torch.Tensor:
    """Row ``row``'s top logprobs ``[count, k]`` at its ``count`` generated positions."""
    end = int(out["unpadded_sequence_lengths"][row])
    return out["topk_logprobs"][row, end - count : end].float()
