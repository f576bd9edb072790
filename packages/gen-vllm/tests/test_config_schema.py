"""gen-vllm's config checking: every key declared or refused, and NeMo RL's keys one by one.

Nothing here starts an engine: configs are completed as ``VllmGeneration`` does before it
starts one, through to the engine arguments (``engine_args_for``), where effects are observed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from gen_interface import GenerationConfigError, configure_generation_config
from gen_interface.nemo_rl_keys import NEMO_RL_GENERATION_KEYS, TRAINING_LOOP_KEYS
from gen_testkit.config_checks import ConfigSchemaChecks, generation_valid_values
from gen_vllm import VllmGeneration
from gen_vllm.config import VLLM_FOREIGN_KEYS, VllmConfig, complete_vllm_config
from gen_vllm.engine_args import engine_args_for
from hypothesis import strategies as st

BASE: dict[str, Any] = {"backend": "vllm", "model_name": "m", "pad_token_id": 0}
TIMEOUT = st.floats(0.1, 1e5)


def engine_args(config: dict[str, Any], *, use_gpus: bool = False, **kw: Any) -> dict[str, Any]:
    """What ``VllmGeneration`` would pass to vLLM for ``config``."""
    completed = complete_vllm_config(configure_generation_config(config, None, **kw))
    return engine_args_for(completed, use_gpus=use_gpus)


class TestVllmConfigSchema(ConfigSchemaChecks):
    schema = VllmConfig
    foreign = VLLM_FOREIGN_KEYS
    base = BASE
    valid = {
        **generation_valid_values("vllm"),
        "vllm_cfg": {
            "tensor_parallel_size": st.integers(1, 8),
            "gpu_memory_utilization": st.floats(0.01, 1.0),
            "max_model_len": st.none() | st.integers(1, 10**6),
            "cpu_kv_cache_gib": st.floats(0.01, 64.0),
            "cpu_threads": st.none() | st.integers(1, 256),
            "kv_cache_dtype": st.sampled_from(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
            "enforce_eager": st.booleans(),
            "enable_prefix_caching": st.booleans(),
            "max_num_seqs": st.integers(1, 4096),
            "load_format": st.sampled_from(["auto", "dummy"]),
            "load_tokenizer": st.booleans() | st.just("auto"),
            "enable_sleep_mode": st.booleans() | st.just("auto"),
            "startup_timeout_s": TIMEOUT,
            "generate_timeout_s": TIMEOUT,
            "update_timeout_s": TIMEOUT,
            "control_timeout_s": TIMEOUT,
            "precision": st.sampled_from(["float32", "bfloat16", "float16"]),
            "skip_tokenizer_init": st.booleans(),
            "logprobs_mode": st.sampled_from(["raw_logprobs", "processed_logprobs"]),
            "async_engine": st.booleans(),
            "enable_return_routed_experts": st.booleans(),
            "max_logprobs": st.integers(0, 4096),
            "weight_deltas": st.booleans(),
            "healing": st.booleans(),
            "max_replica_restarts": st.integers(0, 10**4),
            "wedge_timeout_s": TIMEOUT,
            "refit_deadline_s": TIMEOUT,
        },
    }
    valid[""]["vllm_cfg"] = st.fixed_dictionaries({}, optional=valid["vllm_cfg"])
    valid[""]["vllm_kwargs"] = st.fixed_dictionaries(
        {},
        optional={
            "block_size": st.sampled_from([16, 32]),
            "max_num_batched_tokens": st.integers(64, 8192),
        },
    )

    def complete(self, config: dict[str, Any]) -> Any:
        return engine_args(config)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("wedge_timeout_s", 0, "vllm_cfg.wedge_timeout_s must be a number > 0, got 0"),
        ("wedge_timeout_s", -5.0, "vllm_cfg.wedge_timeout_s must be a number > 0"),
        ("refit_deadline_s", 0.0, "vllm_cfg.refit_deadline_s must be a number > 0"),
        ("max_replica_restarts", -1, "vllm_cfg.max_replica_restarts must be an integer >= 0"),
        ("max_replica_restarts", 2.5, "vllm_cfg.max_replica_restarts` must be an integer"),
        ("healing", "yes", "vllm_cfg.healing"),
    ],
)
def test_bad_healing_settings_are_refused_with_their_path(key, value, message):
    with pytest.raises(GenerationConfigError, match=message):
        engine_args(dict(BASE, vllm_cfg={key: value}))


def test_healing_is_the_default_and_its_bounds_have_defaults():
    cfg = complete_vllm_config(configure_generation_config(dict(BASE), None))["vllm_cfg"]
    assert cfg["healing"] is True and cfg["max_replica_restarts"] == 16
    assert 10 <= cfg["wedge_timeout_s"] <= 60 and cfg["refit_deadline_s"] == 300.0


def test_the_backend_declares_its_schema_to_configure_generation_config():
    assert VllmGeneration.config_schema is VllmConfig
    with pytest.raises(GenerationConfigError, match="`tensor_parallel_size` belongs in `vllm_cfg`"):
        configure_generation_config(dict(BASE, tensor_parallel_size=2), None)
    with pytest.raises(GenerationConfigError, match="did you mean `max_new_tokens`"):
        configure_generation_config(dict(BASE, max_new_token=5), None)
    with pytest.raises(GenerationConfigError, match=r"`vllm_cfg\.enforce_eager` must be a bool"):
        configure_generation_config(dict(BASE, vllm_cfg={"enforce_eager": "False"}), None)


# ---- vllm_kwargs: NeMo RL's pass-through, checked against vllm.EngineArgs --------------------


def test_vllm_kwargs_reach_the_engine_arguments():
    args = engine_args(dict(BASE, vllm_kwargs={"block_size": 32, "max_num_batched_tokens": 256}))
    assert args["block_size"] == 32 and args["max_num_batched_tokens"] == 256


def test_a_misspelt_vllm_kwarg_is_refused_with_the_engine_field_it_meant():
    with pytest.raises(
        GenerationConfigError,
        match=r"unknown key `vllm_kwargs.max_num_batched_tokenz`.*`max_num_batched_tokens`",
    ):
        engine_args(dict(BASE, vllm_kwargs={"max_num_batched_tokenz": 256}))


@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("dtype", "`dtype`"),
        ("seed", "`seed`"),
        ("tensor_parallel_size", "`vllm_cfg.tensor_parallel_size`"),
        ("worker_extension_cls", "worker extension"),
        ("kv_cache_memory_bytes", "cpu_kv_cache_gib"),
    ],
)
def test_engine_arguments_the_backend_sets_are_refused_in_vllm_kwargs(key, instead):
    with pytest.raises(GenerationConfigError, match=f"`vllm_kwargs.{key}` is set by the backend"):
        engine_args(dict(BASE, vllm_kwargs={key: 1}))
    with pytest.raises(GenerationConfigError) as refused:
        engine_args(dict(BASE, vllm_kwargs={key: 1}))
    assert instead in str(refused.value)


def test_engine_kwargs_says_to_use_vllm_kwargs():
    with pytest.raises(GenerationConfigError, match=r"`vllm_cfg\.engine_kwargs`.*`vllm_kwargs`"):
        engine_args(dict(BASE, vllm_cfg={"engine_kwargs": {"block_size": 32}}))
    assert "block_size" not in engine_args(dict(BASE, vllm_cfg={"engine_kwargs": {}}))


# ---- NeMo RL's keys, one row of gen-vllm's README table each ---------------------------------

#: Honoured keys: (level, key, value) -> (engine argument, the value vLLM receives).
HONOURED: list[tuple[str, str, Any, str, Any]] = [
    ("vllm_cfg", "tensor_parallel_size", 2, "tensor_parallel_size", 2),
    ("vllm_cfg", "gpu_memory_utilization", 0.5, "gpu_memory_utilization", 0.5),
    ("vllm_cfg", "max_model_len", 96, "max_model_len", 96),
    ("vllm_cfg", "enforce_eager", False, "enforce_eager", False),
    ("vllm_cfg", "kv_cache_dtype", "fp8", "kv_cache_dtype", "fp8"),
    ("vllm_cfg", "load_format", "dummy", "load_format", "dummy"),
    ("vllm_cfg", "precision", "bfloat16", "dtype", "bfloat16"),
    ("vllm_cfg", "skip_tokenizer_init", True, "skip_tokenizer_init", True),
    ("vllm_cfg", "skip_tokenizer_init", False, "skip_tokenizer_init", False),
    ("vllm_cfg", "logprobs_mode", "processed_logprobs", "logprobs_mode", "processed_logprobs"),
    ("vllm_cfg", "pipeline_parallel_size", 1, "tensor_parallel_size", 1),
    ("vllm_cfg", "expert_parallel_size", 1, "tensor_parallel_size", 1),
    ("", "seed", 2**40 + 3, "seed", 3),
    ("", "vllm_kwargs", {"block_size": 32}, "block_size", 32),
]


@pytest.mark.parametrize(("level", "key", "value", "arg", "expected"), HONOURED)
def test_an_honoured_nemo_rl_key_reaches_vllm(level, key, value, arg, expected):
    config = dict(BASE, **({level: {key: value}} if level else {key: value}))
    assert engine_args(config, use_gpus=True)[arg] == expected


def test_async_engine_is_accepted_either_way_and_changes_nothing():
    plain = engine_args(BASE)
    assert engine_args(dict(BASE, vllm_cfg={"async_engine": True})) == plain
    assert engine_args(dict(BASE, vllm_cfg={"async_engine": False})) == plain


@pytest.mark.parametrize("key", TRAINING_LOOP_KEYS)
def test_training_loop_keys_are_accepted_and_left_for_the_loop(key):
    config = configure_generation_config(dict(BASE, **{key: 0.7}), None)
    assert config[key] == 0.7
    assert engine_args(dict(BASE, **{key: 0.7})) == engine_args(BASE)


def _foreign(*, unread: bool) -> list[tuple[str, str]]:
    """NeMo RL's undeclared keys: those accepted whatever their value, or those refused on."""
    rules = [("", NEMO_RL_GENERATION_KEYS), ("vllm_cfg", VLLM_FOREIGN_KEYS["vllm_cfg"])]
    return [
        (level, key) for level, keys in rules for key, rule in keys.items() if rule.unread == unread
    ]


@pytest.mark.parametrize(("level", "key"), _foreign(unread=True))
def test_a_nemo_rl_key_nothing_here_reads_is_accepted_with_any_value(level, key):
    for value in (True, 3000, "x", {"nested": {"device": "cuda"}}):
        config = dict(BASE, **({level: {key: value}} if level else {key: value}))
        assert engine_args(config) == engine_args(BASE)


#: A value that turns each refusable key on.
ON: dict[str, Any] = {
    "pipeline_parallel_size": 2,
    "expert_parallel_size": 2,
    "engine_kwargs": {"block_size": 32},
    "port_range_low": 20000,
    "port_range_high": 30000,
    "refit_transport": "nccl_reshard",
    "refit_cfg": {"bucket_size": 1},
    "bad_words": ["bad"],
    "env_vars": {"X": "1"},
    "http_refit_server_port": 8000,
    "zmq_refit_server_port": 8001,
    "tool_parser_plugin": "plugin",
    "reasoning_parser_plugin": "plugin",
    "http_refit_api_key_env_var": "KEY",
    "http_server_serving_chat_kwargs": {"x": 1},
    "real_quant_ignore": ["lm_head"],
    "quant_cfg": {"algorithm": "fp8"},
    "video": {"fps": 1},
}
OFF: dict[str, Any] = {"pipeline_parallel_size": 1, "expert_parallel_size": 1}


@pytest.mark.parametrize(("level", "key"), _foreign(unread=False))
def test_a_nemo_rl_key_without_an_equivalent_is_accepted_off_and_refused_on(level, key):
    rule = (VLLM_FOREIGN_KEYS.get(level) or NEMO_RL_GENERATION_KEYS)[key]
    off, on = OFF.get(key), ON.get(key, True)
    assert engine_args(dict(BASE, **({level: {key: off}} if level else {key: off}))) == (
        engine_args(BASE)
    )
    with pytest.raises(GenerationConfigError) as refused:
        engine_args(dict(BASE, **({level: {key: on}} if level else {key: on})))
    path = f"{level}.{key}" if level else key
    assert f"`{path}`" in str(refused.value) and rule.reason in str(refused.value)


def test_nemo_rl_pad_token_id_is_accepted_and_pad_token_id_is_filled_as_usual():
    config = configure_generation_config(
        {"backend": "vllm", "model_name": "m", "_pad_token_id": 9},
        type("T", (), {"pad_token_id": 3, "eos_token_id": 2})(),
    )
    assert config["pad_token_id"] == 3


def test_colocated_resources_are_accepted_null_and_refused_set():
    nulls = {"enabled": False, "resources": {"gpus_per_node": None, "num_nodes": None}}
    assert engine_args(dict(BASE, colocated=nulls)) == engine_args(BASE)
    with pytest.raises(GenerationConfigError, match=r"`colocated\.resources`.*create"):
        engine_args(dict(BASE, colocated={"enabled": False, "resources": {"num_nodes": 2}}))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"precision": "fp8"}, "quantised rollouts are not"),
        ({"skip_tokenizer_init": True, "load_tokenizer": True}, "contradicts"),
    ],
)
def test_nemo_rl_names_that_cannot_be_translated_are_refused(cfg, message):
    with pytest.raises(GenerationConfigError, match=message):
        engine_args(dict(BASE, vllm_cfg=cfg))
    with pytest.raises(GenerationConfigError, match="contradicts `dtype`"):
        engine_args(dict(BASE, dtype="float16", vllm_cfg={"precision": "bfloat16"}))


def test_nemo_rls_enable_return_routed_experts_is_return_routed_experts():
    def complete(**config: Any) -> dict[str, Any]:
        return dict(complete_vllm_config(configure_generation_config(dict(BASE, **config), None)))

    def routed(**config: Any) -> bool:
        return bool(complete(**config)["return_routed_experts"])

    assert routed(vllm_cfg={"enable_return_routed_experts": True})
    assert not routed(vllm_cfg={"enable_return_routed_experts": False})
    assert routed(return_routed_experts=True, vllm_cfg={"enable_return_routed_experts": True})
    assert (
        "enable_return_routed_experts"
        not in complete(vllm_cfg={"enable_return_routed_experts": True})["vllm_cfg"]
    )
    with pytest.raises(GenerationConfigError, match="contradicts `return_routed_experts`"):
        routed(return_routed_experts=True, vllm_cfg={"enable_return_routed_experts": False})


@pytest.mark.parametrize(
    ("is_eval", "load_format"), [(None, "auto"), (True, "auto"), (False, "dummy")]
)
def test_is_eval_decides_whether_the_checkpoint_is_read(is_eval, load_format):
    assert engine_args(BASE, is_eval=is_eval)["load_format"] == load_format
    # NeMo RL overwrites a configured load_format the same way.
    given = dict(BASE, vllm_cfg={"load_format": "dummy"})
    expected = "dummy" if is_eval is None else load_format
    assert engine_args(given, is_eval=is_eval)["load_format"] == expected


#: The ``generation`` section of NeMo RL's examples/configs/grpo_math_1B.yaml (Apache-2.0), its
#: interpolations resolved (a 1024-token sequence, bfloat16), ``model_name`` added as NeMo RL
#: adds it at run time.
NEMO_RL_GRPO_MATH_1B: dict[str, Any] = {
    "port_range_low": 3000,
    "port_range_high": 4999,
    "backend": "vllm",
    "model_name": "m",
    "max_new_tokens": 1024,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "val_temperature": 1.0,
    "val_top_p": 1.0,
    "val_top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "refit_transport": None,
    "real_quant_export_cpu_offload": True,
    "refit_cfg": {
        "nixl": {
            "update_weights_bucket_memory_ratio": 0.05,
            "device": "cuda",
            "backend_name": "UCX",
            "backend_init_params": None,
            "release_after_refit": False,
            "shard_expert_weights": False,
        }
    },
    "mcore_generation_config": {"max_model_len": 1024, "cuda_graph_impl": "local"},
    "vllm_cfg": {
        "async_engine": False,
        "precision": "bfloat16",
        "kv_cache_dtype": "auto",
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 1024,
        "enforce_eager": False,
        "use_tqdm": True,
        "use_deep_gemm": False,
        "num_last_layers_in_bf16": 0,
        "num_first_layers_in_bf16": 0,
        "enable_vllm_metrics_logger": True,
        "vllm_metrics_logger_interval": 0.5,
        "http_refit_api_key_env_var": None,
        "reset_encoder_cache_after_weight_update": False,
        "http_refit_server_port": None,
        "zmq_refit_server_port": None,
    },
    "vllm_kwargs": {},
    "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
}


def test_nemo_rl_s_own_grpo_config_is_accepted_and_means_the_same():
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2})()
    config = configure_generation_config(NEMO_RL_GRPO_MATH_1B, tokenizer, is_eval=False)
    args = engine_args_for(complete_vllm_config(config), use_gpus=True)
    assert args["dtype"] == "bfloat16" and args["logprobs_mode"] == "processed_logprobs"
    assert args["load_format"] == "dummy" and args["max_model_len"] == 1024
    assert args["gpu_memory_utilization"] == 0.6 and args["enforce_eager"] is False
    assert args["enable_sleep_mode"]  # colocated on GPUs
    assert config["stop_token_ids"] == [2] and config["val_temperature"] == 1.0


def _nemo_rl_basic_vllm_test_config(enforce_eager: Any) -> dict[str, Any]:
    """NeMo RL's ``basic_vllm_test_config`` (tests/unit/models/generation/test_vllm_generation.py),
    as its tests write it, on a model of this machine."""
    return {
        "backend": "vllm",
        "model_name": "/models/qwen",
        "tokenizer": {"name": "/models/qwen"},
        "dtype": "bfloat16",
        "max_new_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "val_temperature": 1.0,
        "val_top_p": 1.0,
        "val_top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "vllm_cfg": {
            "precision": "bfloat16",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.7,
            "max_model_len": 1024,
            "async_engine": False,
            "skip_tokenizer_init": False,
            "load_format": "auto",
            "enforce_eager": enforce_eager,
            "kv_cache_dtype": "auto",
        },
        "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
        "vllm_kwargs": {},
    }


def test_nemo_rl_s_basic_vllm_test_config_is_accepted_but_a_string_for_a_bool():
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2})()
    with pytest.raises(GenerationConfigError, match="enforce_eager"):
        configure_generation_config(_nemo_rl_basic_vllm_test_config("False"), tokenizer)
    config = configure_generation_config(_nemo_rl_basic_vllm_test_config(False), tokenizer)
    args = engine_args_for(complete_vllm_config(config), use_gpus=True)
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] is False
    assert args["load_format"] == "auto" and not args["skip_tokenizer_init"]
    assert config["tokenizer"] == {"name": "/models/qwen"}  # the training loop's, kept as given


def _nemo_rl_example_values() -> list[tuple[str, Any]]:
    """(dotted key, value) for every key and value NeMo RL's example configs put in a vLLM
    ``generation`` section (``data/nemo_rl_generation_keys.json`` says how it was gathered)."""
    path = Path(__file__).parent / "data" / "nemo_rl_generation_keys.json"
    catalogue = json.loads(path.read_text())["values"]
    return [(key, value) for key, values in catalogue.items() for value in values]


@pytest.mark.parametrize(("key", "value"), _nemo_rl_example_values())
def test_every_key_of_nemo_rl_s_example_configs_is_honoured_or_refused_with_its_reason(key, value):
    """Each key and value, set in NeMo RL's own grpo_math_1B section, either builds engine
    arguments or is refused by a message that names the key and says why: never as unknown."""
    config = copy.deepcopy(NEMO_RL_GRPO_MATH_1B)
    *levels, name = key.split(".")
    level = config
    for part in levels:
        level = level.setdefault(part, {})
    level[name] = value
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2})()
    try:
        configured = configure_generation_config(config, tokenizer)
        engine_args_for(complete_vllm_config(configured), use_gpus=True)
    except GenerationConfigError as exc:
        message = str(exc)
        assert not message.startswith("unknown key"), message
        assert f"`{key}`" in message or name in message, message
