"""Building the pieces ``HfGeneration`` runs on: the device, the model and the tokenizer."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gen_interface import BackendUnavailableError, GenerationConfigError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.initialization import no_init_weights

from gen_hf.head import load_dtype_for, use_float32_head

__all__ = ["LoadedModel", "load_model", "load_tokenizer", "move_model", "resolve_device"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready to decode, and the limits read from its config.

    Attributes:
        model: the transformers model, in eval mode, gradients off, on its device.
        vocab_size: rows of the input embedding: the largest token id + 1 a prompt may hold.
        context_limit: the longest prompt + generation, or None when the model states none.
        keeps_last_logits: the forward pass takes ``logits_to_keep`` (only the last position's
            logits are computed while decoding).
    """

    model: PreTrainedModel
    vocab_size: int
    context_limit: int | None
    keeps_last_logits: bool


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when a CUDA device is present, else ``cpu``; others as named.

    Raises:
        BackendUnavailableError: a CUDA device was asked for and none is present.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"hf_cfg.device is {name!r} but no CUDA device is present; use 'auto' or 'cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BackendUnavailableError(
                f"hf_cfg.device is {name!r} but only {torch.cuda.device_count()} CUDA "
                "device(s) are present"
            )
    return device


def move_model(model: torch.nn.Module, device: torch.device | str) -> None:
    """Move every weight and buffer of ``model`` to ``device``, in place."""
    model.to(device)


def load_model(config: Mapping[str, Any], device: torch.device) -> LoadedModel:
    """Load ``config["model_name"]`` with ``AutoModelForCausalLM`` onto ``device``; with
    ``hf_cfg.load_format`` ``"dummy"``, build the architecture from its ``config.json`` only
    (randomly initialised: the first weight update brings the weights).

    Args:
        config: a completed ``HfConfig`` (see ``complete_hf_config``).
        device: where the weights live while generating.

    Returns:
        The model with its vocabulary size and context limit.

    Raises:
        GenerationConfigError: the model cannot be loaded from ``model_name``.
    """
    hf_cfg = config["hf_cfg"]
    dtype_name = config.get("dtype", "auto")
    model_dtype: str | torch.dtype = "auto" if dtype_name == "auto" else _DTYPES[dtype_name]
    float32_head = bool(config.get("lm_head_fp32", False))
    dtype = load_dtype_for(model_dtype, float32_head)
    try:
        if hf_cfg["load_format"] == "dummy":  # the architecture only: weights come by update
            model_config = AutoConfig.from_pretrained(
                config["model_name"], trust_remote_code=hf_cfg["trust_remote_code"]
            )
            # No random initialisation (seconds for a large model): the values are never used,
            # since generate refuses until the first update writes every weight. Buffers that
            # are computed, not loaded (rotary frequencies), are still built.
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(
                    model_config,
                    dtype=model_config.dtype if dtype == "auto" else dtype,
                    attn_implementation=hf_cfg["attn_implementation"],
                    trust_remote_code=hf_cfg["trust_remote_code"],
                )
        else:
            model = AutoModelForCausalLM.from_pretrained(
                config["model_name"],
                dtype=dtype,
                attn_implementation=hf_cfg["attn_implementation"],
                trust_remote_code=hf_cfg["trust_remote_code"],
                **hf_cfg["model_kwargs"],
            )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise GenerationConfigError(
            f"model_name {config['model_name']!r} could not be loaded as a causal LM by "
            f"transformers: {str(exc).rstrip('.')}. Give a local model directory or a hub name "
            "that AutoModelForCausalLM loads."
        ) from exc
    if float32_head:
        use_float32_head(model, model_dtype)
    model.eval()
    model.requires_grad_(False)
    move_model(model, device)
    text_config = model.config.get_text_config(decoder=True)
    context_limit = getattr(text_config, "max_position_embeddings", None)
    if hf_cfg["max_model_len"] is not None:
        context_limit = (
            hf_cfg["max_model_len"]
            if context_limit is None
            else min(context_limit, hf_cfg["max_model_len"])
        )
    embeddings = model.get_input_embeddings()
    vocab_size = int(getattr(embeddings, "num_embeddings", text_config.vocab_size))
    forward_parameters = inspect.signature(model.forward).parameters
    return LoadedModel(
        model=model,
        vocab_size=vocab_size,
        context_limit=None if context_limit is None else int(context_limit),
        keeps_last_logits="logits_to_keep" in forward_parameters,
    )


def load_tokenizer(config: Mapping[str, Any]) -> Any | None:
    """The model's tokenizer (stop strings and ``generate_text`` need it), or None.

    With ``hf_cfg.load_tokenizer`` ``"auto"``, a tokenizer that fails to load, or loads with no
    vocabulary beyond its special tokens, means None; with ``True`` it is an error; with
    ``False`` none is loaded.

    Raises:
        GenerationConfigError: ``load_tokenizer`` is True and no tokenizer loads from
            ``model_name``.
    """
    wanted = config["hf_cfg"]["load_tokenizer"]
    if wanted is False:
        return None
    problem: str | None = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            config["model_name"], trust_remote_code=config["hf_cfg"]["trust_remote_code"]
        )
    except (OSError, ValueError, KeyError, ImportError, TypeError) as exc:
        problem = str(exc).rstrip(".")
    else:
        # Without tokenizer files transformers may still build an empty tokenizer of the model's
        # type, which decodes every id to "": stop strings would silently never match.
        if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
            problem = (
                f"the tokenizer found has no vocabulary beyond its {len(tokenizer)} special tokens"
            )
    if problem is not None:
        if wanted == "auto":
            return None
        raise GenerationConfigError(
            f"hf_cfg.load_tokenizer is true but no tokenizer loads from model_name "
            f"{config['model_name']!r}: {problem}. Set it to 'auto' or false to run "
            "without one (stop strings are then refused)."
        )
    return tokenizer
