"""Error paths and the end of weight updates, on the fake engine through the real backend:
engine errors are errors (never length cut-offs), a dead engine breaks the backend and says so,
replicas are compared exactly while paused (and by what their packed layers compute), and
shutdown frees what it can whatever fails."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fake_vllm_engine import arm_corrupt_load, set_fault
from gen_interface import GenerationError, MixedWeightsError
from gen_interface.weights import refit
from gen_testkit.strategies import pad_prompts
from gen_vllm.engine_loop import EngineFailedError

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7]]


def _greedy(backend, **sampling):
    view = backend.with_sampling(**sampling) if sampling else backend
    return view.generate(pad_prompts(PROMPTS, "left"), greedy=True)


@pytest.fixture(scope="module")
def new_weights(tiny_qwen2):
    generator = torch.Generator().manual_seed(8)
    return {
        name: t + 0.3 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in tiny_qwen2.state_dict().items()
    }


def test_rows_vllm_ends_for_an_error_fail_the_call_and_the_engine_goes_on(own, tiny_qwen2):
    """Fails on the main before the shared base: an ``"error"`` finish came back as a row
    truncated for length."""
    backend = own.backend(own.cluster([1]), tiny_qwen2)
    before = _greedy(backend)
    set_fault(own.log_dir, "rows")
    try:
        with pytest.raises(GenerationError, match=r"'error'.*failed inside the engine"):
            _greedy(backend)
    finally:
        set_fault(own.log_dir, "rows", on=False)
    after = _greedy(backend)
    assert torch.equal(after["output_ids"], before["output_ids"])


def test_a_failed_engine_step_breaks_the_backend_and_every_call_says_so(own, tiny_qwen2):
    """Fails on the main before the shared base: the replica refused every row while the
    backend still reported itself ready. Fail-stop, as chosen (a healing fleet replaces the
    replica instead: test_healing_with_fake_engine.py)."""
    backend = own.backend(own.cluster([1]), tiny_qwen2, healing=False)
    set_fault(own.log_dir, "step")
    with pytest.raises(EngineFailedError, match=r"kernel failed.*broken"):
        _greedy(backend)
    set_fault(own.log_dir, "step", on=False)
    for call in (lambda: _greedy(backend), backend.prepare_for_generation):
        with pytest.raises(GenerationError, match=r"is broken \(.*engine step failed"):
            call()


def test_a_healthy_update_while_rows_run_on_one_replica_commits(own, tiny_qwen2, new_weights):
    """Fails on the main before the shared base: the replicas' probe was scored after they
    resumed, beside different rows, and compared exactly; engines whose results move with their
    batch (GPU kernels do) disagreed in the last bits and the backend broke on a healthy refit."""
    backend = own.backend(own.cluster([2]), tiny_qwen2, faults={"batch_variant": True})
    long_rows = backend.with_sampling(max_new_tokens=60, stop_token_ids=[])
    out: dict = {}
    worker = threading.Thread(
        target=lambda: out.update(rows=long_rows.generate(pad_prompts([[5, 6]], "left"), True))
    )
    worker.start()
    while sum(backend.rows_in_flight()) == 0:
        time.sleep(0.02)
    version = refit(backend, new_weights, in_flight="keep")  # one replica busy, one idle
    worker.join(timeout=120)
    assert backend.weight_version == version
    versions = set(out["rows"]["weight_versions"][0, 2:].tolist())
    assert versions <= {version - 1, version}
    assert _greedy(backend).size == len(PROMPTS)


def test_replicas_whose_packed_layers_compute_differently_are_caught(own, tiny_qwen2, new_weights):
    """A load that went wrong in a weight only a packed layer holds (vLLM's CPU linear layers)
    is invisible to parameter checksums; what the packed layers compute on a fixed input, taken
    while the engines are paused, shows it."""
    backend = own.backend(own.cluster([2]), tiny_qwen2)
    arm_corrupt_load(own.log_dir, packed=True)
    with pytest.raises(MixedWeightsError, match=r"packed layers.*broken"):
        refit(backend, new_weights)
    with pytest.raises(GenerationError, match="broken"):
        _greedy(backend)


def test_the_session_ray_has_the_logical_gpus_whichever_package_started_it(fake_engine_shipped):
    """The fake engine needs logical GPUs. In ``pytest packages``, gen-serve's and gen-remote's
    fixtures started the process's Ray first, without them, and the fake-engine tests that
    follow then failed ("use_gpus=True but Ray sees no GPU") or were skipped: every fixture
    now starts the same Ray (``gen_testkit.ray_for_tests``)."""
    from gen_testkit.ray_for_tests import TEST_RAY_GPUS

    assert fake_engine_shipped.cluster_resources().get("GPU", 0) == TEST_RAY_GPUS


def test_shutdown_frees_the_cluster_even_when_stopping_the_engines_fails(
    fake_engine_shipped, tiny_qwen2, tmp_path, monkeypatch
):
    """Fails on the main before the shared base: a failing step of shutdown left the cluster
    the backend started (its placement groups) behind. It failed after other packages' tests
    in one process, whose Ray had no logical GPUs (see the test above)."""
    from fake_vllm_engine import FakeEngineFactory
    from gen_testkit.conformance import conformance_config
    from gen_vllm import VllmGeneration

    config = conformance_config(
        backend="vllm", model_name=str(tiny_qwen2.path), vocab_size=tiny_qwen2.vocab_size
    )
    backend = VllmGeneration.create(
        config, use_gpus=True, engine_factory=FakeEngineFactory(tmp_path)
    )
    cluster = backend._owned_cluster
    assert cluster is not None and cluster._placement_groups
    real_shutdown = backend.replicas.shutdown

    def fails() -> None:
        real_shutdown()
        raise RuntimeError("an engine would not stop")

    monkeypatch.setattr(backend.replicas, "shutdown", fails)
    with pytest.raises(GenerationError, match="engines: RuntimeError: an engine would not stop"):
        backend.shutdown()
    assert cluster._placement_groups == []
    backend.shutdown()  # idempotent, and quiet the second time
    with pytest.raises(GenerationError, match="shut down"):
        _greedy(backend)
