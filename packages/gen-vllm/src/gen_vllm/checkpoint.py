"""The tensors a model's checkpoint holds: what a weight update must match.

vLLM fuses and repacks weights on load, so the engine's own parameters do not tell which
checkpoint names, shapes and dtypes an update may carry. The checkpoint's safetensors headers do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gen_interface import WeightUpdateError

__all__ = ["checkpoint_specs", "find_checkpoint_dir"]


def find_checkpoint_dir(model: str) -> Path:
    """The local directory holding ``model``'s safetensors files (a path or a cached hub name).

    Raises:
        WeightUpdateError: no safetensors checkpoint can be found locally.
    """
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]
            )
        )
    except Exception as exc:
        raise WeightUpdateError(
            f"cannot find a local safetensors checkpoint for {model!r} to check updates against: "
            f"{exc}"
        ) from exc


def checkpoint_specs(
    model: str, dtype: torch.dtype
) -> tuple[dict[str, tuple[list[int], str]], set[str]]:
    """``({name: (shape, dtype name)}, optional names)`` that an update of ``model`` may carry.

    Shapes come from the safetensors headers; the dtype is the engine's (updates are written in
    the dtype the engine runs). ``lm_head.weight`` is optional when the embeddings are tied.
    """
    from safetensors import safe_open

    root = find_checkpoint_dir(model)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {root} to check weight updates against")
    dtype_name = str(dtype).removeprefix("torch.")
    specs: dict[str, tuple[list[int], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                specs[name] = (list(handle.get_slice(name).get_shape()), dtype_name)
    optional: set[str] = set()
    config_file = root / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        tied = config.get("tie_word_embeddings", False)
        embed = specs.get("model.embed_tokens.weight")
        if tied and embed is not None and "lm_head.weight" not in specs:
            specs["lm_head.weight"] = embed
            optional.add("lm_head.weight")
    return specs, optional
