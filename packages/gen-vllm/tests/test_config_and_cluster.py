import pytest
from gen_interface import BackendUnavailableError, GenerationConfigError
from gen_vllm.config import VLLM_CFG_DEFAULTS, complete_vllm_config
from gen_vllm.engine_args import engine_args_for

BASE = {
    "backend": "vllm",
    "model_name": "m",
    "max_new_tokens": 4,
    "temperature": 1.0,
    "top_p": 1.0,
    "pad_token_id": 0,
    "stop_token_ids": [2],
}


def test_defaults_are_filled_and_the_argument_is_not_changed():
    given = dict(BASE, vllm_cfg={"max_model_len": 128})
    config = complete_vllm_config(given)
    assert given["vllm_cfg"] == {"max_model_len": 128}
    assert config["vllm_cfg"] == {**VLLM_CFG_DEFAULTS, "max_model_len": 128}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tensor_parallel_size", 0),
        ("gpu_memory_utilization", 1.5),
        ("max_model_len", -1),
        ("cpu_kv_cache_gib", 0),
        ("cpu_threads", 0),
        ("enforce_eager", "yes"),
        ("load_tokenizer", "maybe"),
        ("engine_kwargs", {"block_size": 32}),
        ("no_such_key", 1),
    ],
)
def test_bad_engine_settings_are_refused_by_name(key, value):
    with pytest.raises(GenerationConfigError, match=key):
        complete_vllm_config(dict(BASE, vllm_cfg={key: value}))


def test_engine_args_on_cpu_and_gpu():
    config = complete_vllm_config(
        dict(BASE, logprobs_mode="processed", seed=7, vllm_kwargs={"block_size": 32})
    )
    cpu = engine_args_for(config, use_gpus=False)
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["seed"] == 7
    assert cpu["kv_cache_memory_bytes"] == 1 << 30 and not cpu["enable_sleep_mode"]
    assert cpu["block_size"] == 32 and "gpu_memory_utilization" not in cpu
    gpu = engine_args_for(config, use_gpus=True)
    assert not gpu["enable_sleep_mode"] and gpu["gpu_memory_utilization"] == 0.8
    colocated = engine_args_for(dict(config, colocated={"enabled": True}), use_gpus=True)
    assert colocated["enable_sleep_mode"]  # sleep only when a trainer shares the GPUs


def test_lm_head_fp32_is_vllms_head_dtype_beside_the_users_own_overrides():
    plain = engine_args_for(complete_vllm_config(BASE), use_gpus=False)
    assert "hf_overrides" not in plain
    config = complete_vllm_config(
        dict(BASE, lm_head_fp32=True, vllm_kwargs={"hf_overrides": {"rope_theta": 5.0}})
    )
    overrides = engine_args_for(config, use_gpus=False)["hf_overrides"]
    assert overrides == {"rope_theta": 5.0, "head_dtype": "float32"}


def test_cluster_reserves_bundles_and_refuses_what_is_not_there(ray_session):
    from gen_vllm import RayVirtualCluster

    with RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1) as cluster:
        assert cluster.world_size == 2 and not cluster.use_gpus
        assert [b.local_index for b in cluster.bundles] == [0, 1]
    with pytest.raises(BackendUnavailableError, match="could not reserve"):
        RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=64, placement_timeout_s=3)
    too_many = int(ray_session.cluster_resources()["GPU"]) + 1
    with pytest.raises(BackendUnavailableError, match="could not reserve"):
        RayVirtualCluster([too_many], use_gpus=True, placement_timeout_s=3)


def test_config_seeds_beyond_32_bits_reach_every_row_and_the_engine_takes_them():
    """vLLM seeds numpy with its engine seed (32 bits); rows carry their own 64-bit seeds."""
    config = complete_vllm_config(dict(BASE, seed=2**40 + 5))
    assert engine_args_for(config, use_gpus=False)["seed"] == 5


def test_batch_invariant_is_refused_on_cpu_before_any_engine_starts(ray_session):
    from gen_vllm import RayVirtualCluster, VllmGeneration

    config = dict(BASE, batch_invariant=True, model_name="never-loaded")
    before = set(ray_session.util.list_named_actors())  # other tests' shared engines
    with RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1) as cluster:
        with pytest.raises(BackendUnavailableError, match=r"needs CUDA.*backend 'hf'"):
            VllmGeneration(cluster, config)
        assert set(ray_session.util.list_named_actors()) == before  # nothing was started


def test_a_cpu_engine_leaves_one_core_of_its_share_to_scheduling_and_messages():
    from gen_vllm.worker import engine_threads

    assert [engine_threads(cores, None) for cores in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert engine_threads(2, 2) == 2, "vllm_cfg.cpu_threads decides when given"


def test_a_placement_a_fixed_size_cluster_cannot_hold_is_refused_at_once(ray_session):
    """``fixed_size=True`` (the default for a Ray the backend starts itself): no waiting
    ``placement_timeout_s`` for resources that can never appear, and the message says what was
    asked and what the nodes hold."""
    import time

    from gen_vllm import RayVirtualCluster

    cpus = ray_session.cluster_resources()["CPU"]
    began = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="fixed-size cluster") as refused:
        RayVirtualCluster(
            [1], use_gpus=False, num_cpus_per_bundle=cpus + 1, placement_timeout_s=120,
            fixed_size=True,
        )  # fmt: skip
    assert time.monotonic() - began < 30
    assert f"bundles of {cpus + 1:g} CPUs" in str(refused.value)
    assert f"{cpus:g} CPUs and" in str(refused.value)


def test_entries_are_matched_to_nodes_not_placed_first_fit():
    """Entry 0 fits either node, entry 1 only the larger: first fit would give entry 0 the
    larger node and call the layout impossible."""
    from gen_vllm.cluster import _fits

    nodes = [{"CPU": 4.0}, {"CPU": 2.0}]
    assert _fits([{"CPU": 2.0}, {"CPU": 4.0}], nodes)
    assert not _fits([{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}], nodes), "an entry per node"
    assert not _fits([{"CPU": 1.0, "GPU": 1.0}], nodes)
