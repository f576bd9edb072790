"""What the backend reads from the model directory, and ``StagedCheckpoint``: the weights of an
update on their way to SGLang.

SGLang reads weights from a checkpoint directory (``/update_weights_from_disk``), and that is
the weight route every SGLang build serves over HTTP on the CPU: ``/update_weights_from_tensor``
takes tensors pickled with torch's multiprocessing reductions (CUDA IPC on a GPU; on the CPU a
file descriptor that only the sending process's resource sharer can hand over), and
``/update_weights_from_distributed`` needs NCCL. So an update is written, verified tensor by
tensor, straight into a safetensors file in shared memory (``/dev/shm``) that the file maps,
and every server loads that file at the commit. Nothing reaches a server before the commit: an
aborted update leaves every server on its old weights, whole.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gen_backend_kit.weights.consumer import TensorSpecs
from gen_interface import GenerationConfigError
from gen_interface.weights.shm import owner_tag, segment_dir, sweep_orphans

__all__ = ["STAGED_PREFIX", "ModelFacts", "StagedCheckpoint", "read_model_facts", "serving_dir"]

#: How a staged checkpoint's directory is named in shared memory, before its owner's tag.
STAGED_PREFIX = "gen-sglang-"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_SERVED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelFacts:
    """What the model directory says, read without loading the model.

    Attributes:
        specs: every weight SGLang loads, ``{name: (shape, dtype)}`` in the served dtype.
        optional: names an update may carry or leave out (the tied head's alias).
        vocab_size, context_length: from ``config.json``.
        eos_token_id, pad_token_id: the model's (None when it names none).
        has_tokenizer: the directory holds a tokenizer.
    """

    specs: dict[str, tuple[torch.Size, torch.dtype]]
    optional: frozenset[str]
    vocab_size: int
    context_length: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    has_tokenizer: bool


def read_model_facts(model_dir: Path, dtype: str) -> ModelFacts:
    """Read ``config.json``, ``generation_config.json`` and the safetensors headers.

    Raises:
        GenerationConfigError: the directory has no ``config.json`` or no safetensors weights.
    """
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(
            f"model_name {str(model_dir)!r} must be a local Hugging Face model directory with "
            f"a config.json for backend 'sglang' ({exc})"
        ) from exc
    text = config.get("text_config", config)
    served = _SERVED.get(dtype)
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, entry in _header(path).items():
            if name != "__metadata__":
                stored = _DTYPES[entry["dtype"]]
                kept = served if served is not None and stored.is_floating_point else stored
                specs[name] = (torch.Size(entry["shape"]), kept)
    if not specs:
        raise GenerationConfigError(
            f"model_name {str(model_dir)!r} has no *.safetensors weights; backend 'sglang' "
            "reads the model's weight names from them"
        )
    optional: set[str] = set()
    embed = "model.embed_tokens.weight"
    if text.get("tie_word_embeddings", config.get("tie_word_embeddings")) and embed in specs:
        specs.setdefault("lm_head.weight", specs[embed])
        optional.add("lm_head.weight")
    generation = _json_or_empty(model_dir / "generation_config.json")
    eos = generation.get("eos_token_id", text.get("eos_token_id"))
    pad = generation.get("pad_token_id", text.get("pad_token_id"))
    return ModelFacts(
        specs,
        frozenset(optional),
        int(text["vocab_size"]),
        text.get("max_position_embeddings"),
        eos[0] if isinstance(eos, list) else eos,
        pad[0] if isinstance(pad, list) else pad,
        any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model")),
    )


class StagedCheckpoint:
    """A checkpoint directory in shared memory whose ``model.safetensors`` is mapped in place:
    ``targets[name]`` is a tensor over that name's bytes in the file, so writing an update's
    tensors into them writes the file.

    The directory holds the model's other files (config, tokenizer) too, since SGLang loads it
    as a model directory. ``root`` (holding ``dir``, and the server's ``serving_dir``) is
    removed on ``close``, when the object is collected, or at exit; its name holds the owner's
    ``owner_tag``, so when the owner dies without a word (SIGKILL, the OOM killer) the next
    staged checkpoint made on the machine removes it (``sweep_orphans``).

    Args:
        model_dir: the model whose non-weight files are copied.
        specs: the weights of the file, ``{name: (shape, dtype)}``.
        optional: names that get a buffer of their own and stay out of the file.
    """

    def __init__(self, model_dir: Path, specs: TensorSpecs, optional: frozenset[str]):
        base = segment_dir()
        sweep_orphans(base, STAGED_PREFIX)
        self.root = Path(tempfile.mkdtemp(prefix=f"{STAGED_PREFIX}{owner_tag()}-", dir=base))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.dir = self.root / "weights"
        self.dir.mkdir()
        for path in model_dir.iterdir():
            weights = path.name.endswith((".safetensors", ".bin", ".pt", ".index.json"))
            if path.is_file() and not weights:
                shutil.copy(path, self.dir / path.name)
        stored = {n: s for n, s in specs.items() if n not in optional}
        # Widest dtypes first: every tensor's offset is then a multiple of its element size.
        order = sorted(stored, key=lambda n: -stored[n][1].itemsize)
        header: dict[str, Any] = {}
        offset = 0
        for name in order:
            shape, dtype = stored[name]
            nbytes = shape.numel() * dtype.itemsize
            header[name] = {
                "dtype": _NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        path = self.dir / "model.safetensors"
        with open(path, "wb") as handle:
            handle.write(struct.pack("<Q", len(text)) + text)
            handle.truncate(start + offset)
        data = torch.from_file(str(path), shared=True, size=start + offset, dtype=torch.uint8)
        self.targets: dict[str, torch.Tensor] = {}
        for name in order:
            shape, dtype = stored[name]
            begin, end = header[name]["data_offsets"]
            self.targets[name] = data[start + begin : start + end].view(dtype).view(shape)
        for name in optional & set(specs):
            self.targets[name] = torch.empty(specs[name][0], dtype=specs[name][1])

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (names and shapes already checked) into the file, cast."""
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.targets[name].copy_(tensor)

    def close(self) -> None:
        self.targets = {}
        self._finalizer()


def serving_dir(model_dir: Path, under: Path) -> Path:
    """A copy of ``model_dir`` for SGLang to start from, in which the model names no eos token.

    SGLang ends a row at the model's eos (config, generation config and tokenizer) on top of
    the request's ``stop_token_ids``, or, with ``ignore_eos``, at neither. The interface stops a
    row at its own stop tokens only (``stop_token_ids`` lists eos when the caller wants it), so
    the server starts from this directory: weights linked, the three files rewritten without
    their eos (the tokenizer keeps ``</s>`` as a special token; only its role is gone).
    """
    out = under / "model"
    out.mkdir()
    for path in model_dir.iterdir():
        target = out / path.name
        if path.name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            data = _json_or_empty(path)
            for section in (data, data.get("text_config") or {}):
                # None, not absent: an absent eos is the config class's default (Llama's: 2).
                if path.name != "tokenizer_config.json":
                    section["eos_token_id"] = None
                else:
                    section.pop("eos_token_id", None)
                if "eos_token" in section:
                    section["eos_token"] = None
            target.write_text(json.dumps(data))
        else:
            target.symlink_to(path.resolve())
    return out


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return dict(json.loads(handle.read(length)))


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
