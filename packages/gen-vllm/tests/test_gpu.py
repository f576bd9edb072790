"""CUDA-only behaviour: sleep mode in the lifecycle and weight updates through CUDA IPC handles.

Skipped where no CUDA device is present (the ``gpu`` marker of the testkit's plugin).
"""

import pytest
import torch
from gen_interface.weights import share_weights
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7]]


@pytest.fixture(scope="module")
def gpu_backend(ray_session, tiny_qwen2):
    from gen_vllm import RayVirtualCluster, VllmGeneration

    cluster = RayVirtualCluster([1], use_gpus=True)
    config = conformance_config(
        backend="vllm",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        vllm_cfg={"gpu_memory_utilization": 0.2},
    )
    backend = VllmGeneration(cluster, config)
    yield backend
    backend.shutdown()
    cluster.shutdown()


def test_finish_sleeps_and_prepare_wakes_with_outputs_unchanged(gpu_backend):
    assert gpu_backend.capabilities.sleep and gpu_backend.capabilities.devices == ("cuda",)
    batch = pad_prompts(PROMPTS, "left")
    before = gpu_backend.generate(batch, greedy=True)
    free_awake, _ = torch.cuda.mem_get_info()
    gpu_backend.finish_generation()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # the engine gave memory back
    gpu_backend.prepare_for_generation()
    after = gpu_backend.generate(batch, greedy=True)
    assert torch.equal(before["output_ids"], after["output_ids"])


def test_a_cuda_ipc_update_changes_outputs_and_restores_them(gpu_backend, tiny_qwen2):
    batch = pad_prompts(PROMPTS, "left")
    before = gpu_backend.generate(batch, greedy=True)
    original = {k: v.cuda() for k, v in tiny_qwen2.state_dict().items()}
    scaled = {k: v * 1.5 if k.endswith("proj.weight") else v for k, v in original.items()}
    with share_weights(scaled) as shared:
        assert {b["transport"] for b in shared.handles["buckets"]} == {"cuda_ipc"}
        gpu_backend.update_weights_from_ipc_handles(shared.handles)
    assert not torch.equal(
        gpu_backend.generate(batch, greedy=True)["output_ids"], before["output_ids"]
    )
    with share_weights(original) as shared:
        gpu_backend.update_weights_from_ipc_handles(shared.handles)
    after = gpu_backend.generate(batch, greedy=True)
    assert torch.equal(after["output_ids"], before["output_ids"])
    assert torch.equal(after["logprobs"], before["logprobs"])
