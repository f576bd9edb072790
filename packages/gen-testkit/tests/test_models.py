import hashlib

import pytest

pytest.importorskip("transformers")

from gen_testkit.models import PRESETS, TinyModelSpec, build_tiny_model

SMALL = TinyModelSpec(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_hidden_layers=1,
)


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_a_spec_gives_byte_identical_weights_every_time(tmp_path, architecture):
    spec = TinyModelSpec(**{**SMALL.__dict__, "architecture": architecture})
    first = build_tiny_model(spec, cache=tmp_path / "a")
    second = build_tiny_model(spec, cache=tmp_path / "b")
    assert _digest(first.path) == _digest(second.path)
    assert (first.path / "tokenizer.json").read_bytes() == (
        second.path / "tokenizer.json"
    ).read_bytes()
    other_seed = build_tiny_model(
        TinyModelSpec(**{**spec.__dict__, "seed": 9}), cache=tmp_path / "a"
    )
    assert _digest(other_seed.path) != _digest(first.path)


def test_built_models_are_cached_and_load_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = build_tiny_model(SMALL, cache=tmp_path)
    mtime = (model.path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(SMALL, cache=tmp_path).path == model.path
    assert (model.path / "model.safetensors").stat().st_mtime_ns == mtime
    hf = AutoModelForCausalLM.from_pretrained(model.path)
    assert hf.config.vocab_size == 320
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    assert len(tokenizer) <= SMALL.vocab_size
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (
        model.pad_token_id,
        model.eos_token_id,
    )
    ids = tokenizer("the policy samples")["input_ids"]
    assert tokenizer.decode(ids) == "the policy samples"
    assert set(model.state_dict()) == set(hf.state_dict())


def test_specs_refuse_heads_vllm_cannot_run():
    with pytest.raises(ValueError, match=">= 32"):
        TinyModelSpec(hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="preset"):
        build_tiny_model("no-such-preset")


def test_the_benchmark_preset_has_about_fifty_million_parameters():
    assert 40e6 < PRESETS["bench-50m"].parameter_count() < 60e6
