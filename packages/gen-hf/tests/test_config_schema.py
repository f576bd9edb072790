"""gen-hf's config checking: every key declared or refused (no model is loaded here)."""

from __future__ import annotations

from typing import Any

import pytest
from gen_hf import HfConfig, HfGeneration, complete_hf_config
from gen_interface import GenerationConfigError, configure_generation_config
from gen_testkit.config_checks import ConfigSchemaChecks, generation_valid_values
from hypothesis import strategies as st

BASE: dict[str, Any] = {"backend": "hf", "model_name": "m", "pad_token_id": 0}


class TestHfConfigSchema(ConfigSchemaChecks):
    schema = HfConfig
    base = BASE
    valid = {
        **generation_valid_values("hf"),
        "hf_cfg": {
            "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1"]),
            "attn_implementation": st.sampled_from(["sdpa", "eager"]),
            "max_batch_size": st.integers(1, 4096),
            "max_model_len": st.none() | st.integers(2, 10**6),
            "load_format": st.sampled_from(["auto", "dummy"]),
            "load_tokenizer": st.booleans() | st.just("auto"),
            "trust_remote_code": st.booleans(),
            "model_kwargs": st.fixed_dictionaries(
                {}, optional={"low_cpu_mem_usage": st.booleans(), "revision": st.just("main")}
            ),
        },
    }
    valid[""]["hf_cfg"] = st.fixed_dictionaries({}, optional=valid["hf_cfg"])

    def complete(self, config: dict[str, Any]) -> Any:
        return complete_hf_config(configure_generation_config(config, None))


def test_the_backend_declares_its_schema_to_configure_generation_config():
    assert HfGeneration.config_schema is HfConfig
    with pytest.raises(GenerationConfigError, match="`attn_implementation` belongs in `hf_cfg`"):
        configure_generation_config(dict(BASE, attn_implementation="sdpa"), None)
    with pytest.raises(GenerationConfigError, match="did you mean `temperature`"):
        configure_generation_config(dict(BASE, temprature=0.7), None)
    with pytest.raises(GenerationConfigError, match="unknown key `vllm_cfg`"):
        configure_generation_config(dict(BASE, vllm_cfg={}), None)


@pytest.mark.parametrize(
    ("is_eval", "load_format"), [(None, "auto"), (True, "auto"), (False, "dummy")]
)
def test_is_eval_decides_whether_the_checkpoint_is_read(is_eval, load_format):
    config = complete_hf_config(configure_generation_config(BASE, None, is_eval=is_eval))
    assert config["hf_cfg"]["load_format"] == load_format
