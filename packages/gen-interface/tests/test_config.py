from typing import TypedDict

import pytest
from gen_backend_kit.settings import check_int_setting, complete_backend_settings
from gen_interface import (
    GenerationConfig,
    GenerationConfigError,
    configure_generation_config,
    validate_generation_config,
    with_per_call_overrides,
)
from gen_testkit.strategies import generation_configs, invalid_config_fields
from hypothesis import given


class Tok:
    def __init__(self, pad, eos):
        self.pad_token_id, self.eos_token_id = pad, eos


BASE = {"backend": "hf", "model_name": "some/model"}


@given(bad=invalid_config_fields())
def test_every_out_of_range_field_is_refused_with_its_name(bad):
    field, value = bad
    config = configure_generation_config(BASE, Tok(0, 2))
    config[field] = value
    with pytest.raises(GenerationConfigError) as refused:
        validate_generation_config(config)
    assert field in str(refused.value)


@given(config=generation_configs(backend="hf", model_name="m", vocab_size=64))
def test_valid_configs_pass(config):
    validate_generation_config(config)
    configured = configure_generation_config(config, None)
    assert configured == dict(config, stop_token_ids=config["stop_token_ids"] or [])


def test_configure_fills_defaults_without_mutating_its_argument():
    original = dict(BASE, temperature=0.5, hf_cfg={"max_batch_size": 1})
    snapshot = {k: (dict(v) if isinstance(v, dict) else v) for k, v in original.items()}
    config = configure_generation_config(original, Tok(None, 2))
    assert original == snapshot
    assert config["pad_token_id"] == 2  # no pad token: falls back to eos
    assert config["stop_token_ids"] == [2]
    assert config["temperature"] == 0.5 and config["top_p"] == 1.0 and config["top_k"] is None
    assert config["logprobs_mode"] == "raw" and config["colocated"] == {"enabled": False}
    assert config["hf_cfg"] == {"max_batch_size": 1}
    config["colocated"]["enabled"] = True
    assert configure_generation_config(original, Tok(0, 2))["colocated"] == {"enabled": False}


def test_configure_keeps_callers_values_and_needs_a_pad_id():
    config = configure_generation_config(dict(BASE, stop_token_ids=[], pad_token_id=5), Tok(0, 2))
    assert config["stop_token_ids"] == [] and config["pad_token_id"] == 5
    with pytest.raises(GenerationConfigError, match="pad_token_id"):
        configure_generation_config(BASE, Tok(None, None))


def test_per_call_overrides_change_only_per_call_settings():
    config = configure_generation_config(dict(BASE, seed=1), Tok(0, 2))
    derived = with_per_call_overrides(config, {"temperature": 0.0, "max_new_tokens": 3})
    assert derived["temperature"] == 0.0 and derived["max_new_tokens"] == 3
    assert config["max_new_tokens"] == 64  # the original is untouched
    with pytest.raises(GenerationConfigError, match="logprobs_mode"):
        with_per_call_overrides(config, {"logprobs_mode": "processed"})
    with pytest.raises(GenerationConfigError, match="top_p"):
        with_per_call_overrides(config, {"top_p": 0.0})


class XSettings(TypedDict, total=False):
    size: int
    mode: str


class XConfig(GenerationConfig, total=False):
    x_cfg: XSettings


def test_backend_settings_are_completed_and_checked_by_path():
    config = configure_generation_config(BASE, Tok(0, 2))
    config = dict(config, x_cfg={"size": 4})
    defaults = {"size": 1, "mode": "a"}
    out, settings = complete_backend_settings(config, "x_cfg", defaults, schema=XConfig)
    assert settings == {"size": 4, "mode": "a"} and out is not config
    check_int_setting(settings, "x_cfg", "size", minimum=4)
    with pytest.raises(GenerationConfigError, match=r"x_cfg\.size must be an integer >= 5"):
        check_int_setting(settings, "x_cfg", "size", minimum=5)
    with pytest.raises(
        GenerationConfigError, match=r"unknown key `x_cfg\.sise`: did you mean `size`"
    ):
        complete_backend_settings(
            dict(config, x_cfg={"sise": 1}), "x_cfg", defaults, schema=XConfig
        )
    with pytest.raises(GenerationConfigError, match="`x_cfg` must be a dict"):
        complete_backend_settings(dict(config, x_cfg=[]), "x_cfg", defaults, schema=XConfig)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_seeds_outside_64_bits_are_refused(seed):
    # Not an integer: refused by type; out of range: refused by range.
    in_words = r"`seed` must be an integer or null" if isinstance(seed, bool | float) else None
    in_range = r"seed must be .*\[0, 18446744073709551615\]"
    with pytest.raises(GenerationConfigError, match=in_words or in_range):
        configure_generation_config(dict(BASE, seed=seed), Tok(0, 2))


def test_the_largest_64_bit_seed_is_accepted():
    assert configure_generation_config(dict(BASE, seed=2**64 - 1), Tok(0, 2))["seed"] == 2**64 - 1
