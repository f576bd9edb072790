"""The tensors a model's checkpoint holds: what a weight update must match.

vLLM fuses and repacks weights on load, so the engine's own parameters do not tell which
checkpoint names, shapes and dtypes an update may carry. The checkpoint's safetensors headers do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from gen_interface import WeightUpdateError
from gen_interface.weights import TensorSpecs, check_weights_match

__all__ = ["check_update_is_complete", "checkpoint_specs", "find_checkpoint_dir"]


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


def check_update_is_complete(
    incoming: TensorSpecs, specs: Mapping[str, tuple[list[int], str]], optional: set[str]
) -> None:
    """Refuse an update that does not match the checkpoint or leaves a tensor out.

    vLLM reloads whole (fused) layers, so an update must carry every checkpoint tensor: a
    partial one would leave layers half-loaded.

    Raises:
        WeightUpdateError: naming the mismatched, unknown or missing tensors.
    """
    model = {name: (torch.Size(shape), getattr(torch, dt)) for name, (shape, dt) in specs.items()}
    check_weights_match(incoming, model)
    missing = sorted(set(specs) - optional - set(incoming))
    if missing:
        listed = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise WeightUpdateError(
            f"weight update refused, nothing was written: vLLM reloads whole layers, so an update "
            f"must carry every checkpoint tensor; missing {listed}"
        )
