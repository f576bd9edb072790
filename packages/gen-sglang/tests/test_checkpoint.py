"""``serving_dir``: the copy SGLang starts from names no eos token, in a way that no config class
fills back in with its own default (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

from gen_sglang.checkpoint import serving_dir


def test_the_serving_copy_names_no_eos_and_keeps_the_rest(tmp_path: Path):
    model = tmp_path / "model-in"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos": 1}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (model / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "under").mkdir()

    out = serving_dir(model, tmp_path / "under")

    config = json.loads((out / "config.json").read_text())
    # Null, not absent: transformers' LlamaConfig reads an absent eos_token_id as 2.
    assert "eos_token_id" in config and config["eos_token_id"] is None
    assert config["model_type"] == "llama"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"eos_token_id": None, "bos": 1}
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"eos_token": None}
    assert (out / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
