"""Cross-backend parity over HTTP: the remote backend, with gen-hf and with gen-vllm behind a
gen-serve server, against the in-process Hugging Face reference: greedy tokens identical, raw
logprobs within the float32 tolerances, sampled tokens fitting the exact distribution."""

from __future__ import annotations

import pytest
from gen_hf import HfGeneration
from gen_interface import create_generation_backend
from gen_testkit.config_checks import for_backend
from gen_testkit.conformance import conformance_config
from gen_testkit.models import TinyModel
from gen_testkit.parity import HfLogitsOracle, TimedBackend, parity_batches, run_pair, sampling_plan
from gen_testkit.tolerances import tolerance_for
from remote_servers import ServedModels


@pytest.mark.parametrize("behind", ["hf", "vllm"])
def test_remote_matches_the_reference(served: ServedModels, tiny_qwen2: TinyModel, behind: str):
    server = served.get(behind, tiny_qwen2)
    config = conformance_config(
        backend="remote",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        remote_cfg={"base_url": server.url},
    )
    remote = create_generation_backend(config)
    reference = HfGeneration(
        {**for_backend(remote.config, "hf"), "hf_cfg": {"device": "cpu"}}  # type: ignore[typeddict-item]
    )
    try:
        report = run_pair(
            TimedBackend("hf", reference),
            TimedBackend(f"remote ({behind})", remote),
            oracle=HfLogitsOracle(str(tiny_qwen2.path)),
            batches=parity_batches(tiny_qwen2.vocab_size),
            plan=sampling_plan(tiny_qwen2.vocab_size, 400),
            tolerance=tolerance_for("float32", across_backends=True),
            dtype="float32",
        )
    finally:
        reference.shutdown()
        remote.shutdown()
    assert report.ok, report.failures
    assert report.greedy.agree == report.rows
    assert report.teacher_forced.count > 0
