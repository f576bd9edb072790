"""gen-sglang's config checking, and what it refuses before any server starts."""

from __future__ import annotations

from typing import Any

import pytest
from gen_interface import GenerationConfigError, configure_generation_config
from gen_sglang import SglangConfig, SglangGeneration
from gen_sglang.config import complete_sglang_config
from gen_testkit.config_checks import ConfigSchemaChecks, generation_valid_values
from gen_testkit.models import TinyModel
from hypothesis import strategies as st

BASE: dict[str, Any] = {"backend": "sglang", "model_name": "m", "pad_token_id": 0}


class TestSglangConfigSchema(ConfigSchemaChecks):
    schema = SglangConfig
    base = BASE
    valid = {
        **generation_valid_values("sglang"),
        "sglang_cfg": {
            "python": st.none() | st.just("/opt/sglang/bin/python"),
            "num_replicas": st.integers(1, 64),
            "device": st.sampled_from(["auto", "cpu", "cuda"]),
            "kv_cache_gib": st.none() | st.floats(0.001, 64.0),
            "cpu_threads": st.none() | st.integers(1, 64),
            "mem_fraction_static": st.none() | st.floats(0.01, 1.0),
            "max_total_tokens": st.none() | st.integers(2, 10**6),
            "context_length": st.none() | st.integers(2, 10**6),
            "radix_cache": st.booleans(),
            "start_timeout_s": st.floats(0.1, 10**4),
            "timeout_s": st.floats(0.1, 10**4),
            "extra_args": st.lists(st.sampled_from(["--log-level", "warning"]), max_size=2),
            "load_format": st.sampled_from(["auto", "dummy"]),
            "healing": st.booleans(),
            "max_replica_restarts": st.integers(0, 100),
            "wedge_timeout_s": st.floats(0.1, 10**4),
            "chunk_tokens": st.integers(1, 1024),
        },
    }
    valid[""]["sglang_cfg"] = st.fixed_dictionaries({}, optional=valid["sglang_cfg"])

    def complete(self, config: dict[str, Any]) -> Any:
        return complete_sglang_config(configure_generation_config(config, None))


def test_the_backend_declares_its_schema_to_configure_generation_config():
    assert SglangGeneration.config_schema is SglangConfig
    with pytest.raises(GenerationConfigError, match="`num_replicas` belongs in `sglang_cfg`"):
        configure_generation_config(dict(BASE, num_replicas=2), None)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("batch_invariant", True),
        ("lm_head_fp32", True),
        ("return_routed_experts", True),
        ("colocated", {"enabled": True}),
    ],
)
def test_what_sglang_does_not_offer_is_refused_by_name_before_a_server_starts(
    tiny_qwen2: TinyModel, setting: str, value: Any
):
    with pytest.raises(GenerationConfigError, match=setting.split(".")[0]):
        SglangGeneration({"backend": "sglang", "model_name": str(tiny_qwen2.path), setting: value})


def test_a_model_that_is_not_a_local_directory_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(GenerationConfigError, match="local Hugging Face model directory"):
        SglangGeneration({"backend": "sglang", "model_name": str(tmp_path / "missing")})


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2", True])
def test_cpu_threads_that_are_not_a_positive_integer_are_refused_by_name(threads):
    refused = r"sglang_cfg\.cpu_threads`? must be an integer"
    with pytest.raises(GenerationConfigError, match=refused):
        complete_sglang_config(
            configure_generation_config({**BASE, "sglang_cfg": {"cpu_threads": threads}}, None)
        )
