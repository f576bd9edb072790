"""vLLM against the Hugging Face reference on the same tiny float32 models and inputs: greedy
tokens identical, raw and processed logprobs within the float32 tolerances, sampled tokens fitting
the exact distribution; for two replicas as for one; on the MoE model, every routed expert as
transformers' routers choose it."""

import pytest
from gen_hf import HfGeneration
from gen_testkit.config_checks import for_backend
from gen_testkit.parity import (
    HfLogitsOracle,
    TimedBackend,
    parity_batches,
    run_pair,
    sampling_plan,
)
from gen_testkit.tolerances import tolerance_for


@pytest.mark.parametrize(
    ("model_name", "replicas", "logprobs_mode"),
    [
        ("tiny_qwen2", 1, "raw"),
        ("tiny_qwen2", 2, "raw"),
        ("tiny_llama", 1, "processed"),
        ("tiny_qwen2_tied", 1, "raw"),
        ("tiny_qwen3_moe", 1, "raw"),
    ],
)
def test_vllm_matches_the_reference(request, engines, model_name, replicas, logprobs_mode):
    model = request.getfixturevalue(model_name)
    moe = model_name == "tiny_qwen3_moe"  # and the routed experts, against transformers'
    extra = {"return_routed_experts": True} if moe else {}
    vllm = engines.get(model, replicas=replicas, logprobs_mode=logprobs_mode, **extra)
    assert vllm.num_replicas == replicas
    reference = HfGeneration(for_backend(vllm.config, "hf"))
    try:
        report = run_pair(
            TimedBackend("hf", reference),
            TimedBackend(f"vllm x{replicas}", vllm),
            oracle=HfLogitsOracle(str(model.path)),
            batches=parity_batches(model.vocab_size),
            plan=sampling_plan(model.vocab_size, 400),
            tolerance=tolerance_for("float32", across_backends=True),
            dtype="float32",
        )
    finally:
        reference.shutdown()
    assert report.ok, report.failures
    assert report.greedy.agree == report.rows  # no splits at all in float32, not even near-ties
    assert report.teacher_forced.count > 0
    if logprobs_mode == "processed":
        assert all(error.count > 0 for error in report.processed.values())
    if moe:
        assert sorted(report.routing) == ["hf", "vllm x1"]
        assert all(r.compared > 0 and not r.mismatches for r in report.routing.values())
