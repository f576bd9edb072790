"""CUDA acceptance: what the fake engine stands in for, on real GPUs with vLLM's CUDA build.

Skipped where no CUDA device is present (the ``gpu`` marker of the testkit's plugin); the
two-GPU tests skip on one GPU. Run them all with the GPU acceptance command in the README.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from gen_interface import GenerationError
from gen_interface.weights import share_weights
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7], [300, 12, 1]]


@pytest.fixture
def gpu_backends(ray_session):
    """Builds GPU backends on their own clusters; shuts everything down after the test."""
    from gen_vllm import RayVirtualCluster, VllmGeneration

    made = []

    def make(model_path, *, colocated=False, bundles=1, tp=1, prefix="gpu", vllm_cfg=None, **extra):
        cluster = RayVirtualCluster([bundles], use_gpus=True, max_colocated_worker_groups=2)
        config = conformance_config(
            backend="vllm",
            model_name=str(model_path),
            vocab_size=512,
            colocated={"enabled": colocated},
            vllm_cfg={
                "gpu_memory_utilization": 0.2,
                "tensor_parallel_size": tp,
                **(vllm_cfg or {}),
            },
            **extra,
        )
        backend = VllmGeneration(cluster, config, prefix)
        made.append((backend, cluster))
        return backend

    yield make
    for backend, cluster in made:
        backend.shutdown()
        cluster.shutdown()


def greedy(backend):
    return backend.generate(pad_prompts(PROMPTS, "left"), greedy=True)


def new_weights(model, device="cuda"):
    generator = torch.Generator().manual_seed(5)
    return {
        name: (t + 0.3 * t.std() * torch.randn(t.shape, generator=generator)).to(device)
        for name, t in model.state_dict().items()
    }


def saved(model, weights, where):
    from safetensors.torch import save_file

    shutil.copytree(model.path, where)
    save_file(
        {k: v.cpu().contiguous() for k, v in weights.items()}, str(where / "model.safetensors")
    )
    return where


def assert_same(a, b):
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-6, rtol=0)


def test_colocated_refit_gives_what_a_fresh_engine_on_the_new_weights_gives(
    gpu_backends, tiny_qwen2, tmp_path
):
    """generate -> finish (sleep) -> update from CUDA IPC -> prepare -> generate."""
    backend = gpu_backends(tiny_qwen2.path, colocated=True)
    caps = backend.capabilities
    assert caps.sleep and caps.devices == ("cuda",) and "cuda_ipc" in caps.weight_transports
    before = greedy(backend)
    free_awake, _ = torch.cuda.mem_get_info()
    backend.finish_generation()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # the engine gave memory back to the trainer
    new = new_weights(tiny_qwen2)
    with share_weights(new, devices=[d for ids in backend.device_ids() for d in ids]) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    with pytest.raises(GenerationError, match="after finish_generation"):
        greedy(backend)
    backend.prepare_for_generation()
    after = greedy(backend)
    fresh = gpu_backends(saved(tiny_qwen2, new, tmp_path / "new"), prefix="fresh")
    assert_same(after, greedy(fresh))
    assert not torch.equal(after["logprobs"], before["logprobs"])


def test_finish_then_prepare_without_an_update_keeps_the_outputs(gpu_backends, tiny_qwen2):
    backend = gpu_backends(tiny_qwen2.path, colocated=True)
    before = greedy(backend)
    backend.finish_generation()
    backend.prepare_for_generation(tags=["weights"])
    backend.prepare_for_generation(tags=["kv_cache"])
    assert_same(greedy(backend), before)


def test_dedicated_gpus_do_not_sleep(gpu_backends, tiny_qwen2):
    backend = gpu_backends(tiny_qwen2.path, colocated=False)
    assert not backend.capabilities.sleep
    before = greedy(backend)
    backend.finish_generation()
    backend.prepare_for_generation()
    assert_same(greedy(backend), before)


def test_two_replicas_refit_from_one_trainer_gpu(gpu_backends, tiny_qwen2, tmp_path):
    """One copy of the weights per generation GPU, shared from the trainer's GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    backend = gpu_backends(tiny_qwen2.path, bundles=2)
    new = new_weights(tiny_qwen2, "cuda:0")
    gpus = [d for ids in backend.device_ids() for d in ids]
    assert len(set(gpus)) == 2
    with share_weights(new, devices=gpus) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    fresh = gpu_backends(saved(tiny_qwen2, new, tmp_path / "new"), prefix="fresh")
    assert_same(greedy(backend), greedy(fresh))


def test_tensor_parallel_refit_verifies_rank_by_rank(gpu_backends, tiny_qwen2, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    backend = gpu_backends(tiny_qwen2.path, bundles=2, tp=2, colocated=True)
    new = new_weights(tiny_qwen2, "cuda:0")
    backend.finish_generation()
    gpus = [d for ids in backend.device_ids() for d in ids]
    with share_weights(new, devices=gpus) as shared:
        backend.update_weights_from_ipc_handles(shared.handles)
    backend.prepare_for_generation()
    fresh = gpu_backends(saved(tiny_qwen2, new, tmp_path / "new"), bundles=2, tp=2, prefix="f")
    assert_same(greedy(backend), greedy(fresh))


def test_batch_invariant_mode_gives_a_row_the_same_logprobs_in_any_batch(gpu_backends, tiny_qwen2):
    """vLLM's own batch-invariant kernels (VLLM_BATCH_INVARIANT) behind ``batch_invariant``."""
    backend = gpu_backends(tiny_qwen2, batch_invariant=True, prefix="gpu-bi")
    assert backend.capabilities.batch_invariant
    together = backend.generate(pad_prompts(PROMPTS * 8, "left"), greedy=True)
    for i, prompt in enumerate(PROMPTS):
        alone = backend.generate(pad_prompts([prompt], "right"), greedy=True)
        n = int(alone["unpadded_sequence_lengths"][0])
        assert torch.equal(together["output_ids"][i, :n], alone["output_ids"][0, :n])
        assert torch.equal(together["logprobs"][i, :n], alone["logprobs"][0, :n])


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_routed_experts_on_gpu_route_as_transformers_does(
    gpu_backends, tiny_qwen3_moe, enforce_eager
):
    """Eager: the worker's capture; compiled: vLLM's own option (Model Runner V2). Both give
    every read position's experts as transformers' routers choose them, float32."""
    from gen_testkit.routing import compare_routing, reference_routing
    from transformers import AutoModelForCausalLM

    backend = gpu_backends(
        tiny_qwen3_moe.path,
        return_routed_experts=True,
        vllm_cfg={"enforce_eager": enforce_eager},
    )
    out = greedy(backend)
    totals = out["unpadded_sequence_lengths"].tolist()
    sequences = [out["output_ids"][i, :n].tolist() for i, n in enumerate(totals)]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe.path), dtype=torch.float32)
    result = compare_routing(
        [out["routed_experts"][i, : n - 1] for i, n in enumerate(totals)],
        [reference_routing(model, s, 2) for s in sequences],
    )
    assert result.compared and not result.mismatches, result
