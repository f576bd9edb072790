"""Adapter-only LoRA refit on vLLM: after an adapter refit (through the weight transaction, vLLM
serving it in place), outputs are those of the base model with the adapter merged in (gen-hf
loaded with the merged weights); a refit dropped midway leaves the previous adapter serving; a
base refit and adapter refits mix in one run."""

from __future__ import annotations

import pytest
import torch
from gen_interface import WeightUpdateError
from gen_interface.weights import Refitter, share_weights
from gen_testkit.adapters import merge_adapter, random_adapter
from gen_testkit.strategies import pad_prompts, score_batch

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7, 7, 7, 7], [300, 12, 40, 41, 43]]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
#: float32, vLLM's LoRA kernels (x A^T B^T added to the base layer's output) against gen-hf
#: with the merged weight: the project's float32 bound across backends.
ATOL = 2e-5


@pytest.fixture(scope="module")
def pair(tiny_qwen2):
    """(vLLM with an adapter, gen-hf without: it takes merged weights to compare with)."""
    from gen_hf import HfGeneration
    from gen_testkit.conformance import conformance_config
    from gen_vllm import RayVirtualCluster, VllmGeneration

    def config(backend: str, **extra):
        return conformance_config(
            backend=backend,
            model_name=str(tiny_qwen2.path),
            vocab_size=tiny_qwen2.vocab_size,
            **extra,
        )

    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    vllm = VllmGeneration(cluster, config("vllm", lora=LORA, vllm_cfg={"cpu_kv_cache_gib": 0.25}))
    hf = HfGeneration(config("hf", hf_cfg={"device": "cpu"}))
    yield vllm, hf
    vllm.shutdown()
    hf.shutdown()
    cluster.shutdown()


def _same_outputs(vllm, hf) -> None:
    """Greedy rows equal; sampled rows' logprobs equal the merged model's teacher-forced ones."""
    batch = pad_prompts(PROMPTS, "right")
    mine, theirs = vllm.generate(batch, greedy=True), hf.generate(batch, greedy=True)
    assert torch.equal(mine["output_ids"], theirs["output_ids"])
    torch.testing.assert_close(mine["logprobs"], theirs["logprobs"], atol=ATOL, rtol=0)
    sampled = vllm.generate(batch, greedy=False)
    totals = sampled["unpadded_sequence_lengths"].tolist()
    sequences = [sampled["output_ids"][i, :n].tolist() for i, n in enumerate(totals)]
    scored = hf.score(score_batch(sequences, [len(p) for p in PROMPTS]))
    torch.testing.assert_close(sampled["logprobs"], scored, atol=ATOL, rtol=0)


def test_a_new_adapter_serves_the_base_model(pair, tiny_qwen2):
    vllm, hf = pair
    hf.update_weights_from_state_dict(tiny_qwen2.state_dict())
    _same_outputs(vllm, hf)


def test_after_adapter_refits_outputs_are_the_merged_models(pair, tiny_qwen2):
    vllm, hf = pair
    before = vllm.weight_version
    with Refitter(vllm) as refitter:
        for seed in (1, 2):  # the second replaces the first, in place
            lora = random_adapter(tiny_qwen2.state_dict(), LORA, seed=seed)
            refitter.refit(lora)
            hf.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), lora, LORA))
            _same_outputs(vllm, hf)
    assert vllm.weight_version == before + 2
    out = vllm.generate(pad_prompts(PROMPTS[:1], "right"), greedy=True)
    assert int(out["weight_version"][0]) == vllm.weight_version


def test_a_refit_dropped_midway_leaves_the_previous_adapter_serving(pair, tiny_qwen2):
    vllm, hf = pair
    served = random_adapter(tiny_qwen2.state_dict(), LORA, seed=3)
    with Refitter(vllm) as refitter:
        refitter.refit(served)
    hf.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), served, LORA))
    version = vllm.weight_version
    vllm.start_weight_update()
    with share_weights(
        dict(list(random_adapter(tiny_qwen2.state_dict(), LORA, seed=4, scale=1.0).items())[:4])
    ) as shared:
        vllm.update_weights_from_ipc_handles(shared.handles)
    with pytest.raises(WeightUpdateError, match=r"missing .*lora"):
        vllm.commit_weight_update()
    assert vllm.weight_version == version and vllm.state == "ready"
    _same_outputs(vllm, hf)


def test_a_base_refit_keeps_the_adapter(pair, tiny_qwen2):
    vllm, hf = pair
    lora = random_adapter(tiny_qwen2.state_dict(), LORA, seed=5)
    base = {n: t * 0.9 if t.dim() == 2 else t for n, t in tiny_qwen2.state_dict().items()}
    with Refitter(vllm) as refitter:
        refitter.refit({**base, **lora})  # both in one update
        hf.update_weights_from_state_dict(merge_adapter(base, lora, LORA))
        _same_outputs(vllm, hf)
        refitter.refit(tiny_qwen2.state_dict())  # the base alone
    hf.update_weights_from_state_dict(merge_adapter(tiny_qwen2.state_dict(), lora, LORA))
    _same_outputs(vllm, hf)
