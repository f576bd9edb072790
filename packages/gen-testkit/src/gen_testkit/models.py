"""Small random-weight causal LMs with a matching small tokenizer, built deterministically.

Models cannot be downloaded in CI, so tests and the default demo build their own: a Hugging Face
model directory (config, safetensors weights, tokenizer) that any backend loads like a real one.
A given ``TinyModelSpec`` always gives byte-identical weights: every tensor is drawn from its own
generator, seeded from the spec's seed and the tensor's name, independent of transformers' init
order. Built models are cached on disk under a key derived from the spec.

Needs transformers (``gen-testkit[models]``); it is imported only when a model is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

__all__ = [
    "PRESETS",
    "TinyModel",
    "TinyModelSpec",
    "build_tiny_model",
    "model_cache_dir",
]

Architecture = Literal["qwen2", "llama", "qwen3_moe"]

_FORMAT = 2  # bump when the build recipe changes, so old caches are not reused (2: chat template)
_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a tiny model. Equal specs give byte-identical models.

    ``init_std`` is larger than a trained model's would suggest so that the random model's
    next-token distributions are peaked enough for greedy decoding to be well separated (few
    near-ties) yet spread enough for sampling to vary.
    """

    architecture: Architecture = "qwen2"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head_dim = hidden / heads; vLLM's CPU kernels need >= 32
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    init_std: float = 0.15
    seed: int = 0
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix (most small RL models)
    # qwen3_moe only: every layer's MLP is num_experts experts of moe_intermediate_size, of which
    # a router picks num_experts_per_tok per token (softmax, then top-k, weights renormalised).
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64

    def __post_init__(self) -> None:
        head_dim, rest = divmod(self.hidden_size, self.num_attention_heads)
        if rest or head_dim < 32:
            raise ValueError(
                "hidden_size / num_attention_heads must be an integer >= 32 (vLLM's CPU "
                f"attention refuses smaller heads), got "
                f"{self.hidden_size}/{self.num_attention_heads}"
            )
        if (self.architecture == "qwen3_moe") != (self.num_experts > 0):
            raise ValueError(
                f"num_experts must be > 0 exactly for architecture 'qwen3_moe', got "
                f"{self.num_experts} for {self.architecture!r}"
            )
        if self.vocab_size < 320:
            raise ValueError(
                f"vocab_size must be >= 320 (256 byte tokens, specials and some merges), "
                f"got {self.vocab_size}"
            )

    @property
    def key(self) -> str:
        """A short, stable name for the spec, used as its cache directory."""
        fields = dataclasses.asdict(self)
        if not fields["tie_word_embeddings"]:  # keys of specs from before the field stay put
            del fields["tie_word_embeddings"]
        if not fields["num_experts"]:  # nor do dense specs' keys change with the MoE fields
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                del fields[name]
        blob = json.dumps({"format": _FORMAT, **fields}, sort_keys=True)
        return f"{self.architecture}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"

    def parameter_count(self) -> int:
        h, i, v, n = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.num_hidden_layers,
        )
        kv = h // self.num_attention_heads * self.num_key_value_heads
        biases = {"qwen2": h + 2 * kv, "qwen3_moe": 2 * (h // self.num_attention_heads)}
        attn = h * h * 2 + h * kv * 2 + biases.get(self.architecture, 0)
        embeddings = (1 if self.tie_word_embeddings else 2) * v * h
        mlp = 3 * h * i
        if self.num_experts:  # the experts, and the router's [experts, hidden] matrix
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        return embeddings + n * (attn + mlp + 2 * h) + h


#: Named specs used across the project's tests, benchmarks and the parity command.
PRESETS: dict[str, TinyModelSpec] = {
    "tiny-qwen2": TinyModelSpec(architecture="qwen2"),
    "tiny-llama": TinyModelSpec(architecture="llama", seed=1),
    # lm_head tied to the embeddings: the checkpoint holds one matrix under one name.
    "tiny-qwen2-tied": TinyModelSpec(architecture="qwen2", seed=2, tie_word_embeddings=True),
    # About 50M parameters: the size the throughput benchmarks use.
    "bench-50m": TinyModelSpec(
        architecture="qwen2",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        init_std=0.05,
    ),
    # About 250M parameters (1 GiB in float32): the larger model of the refit benchmark.
    "bench-250m": TinyModelSpec(
        architecture="qwen2",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        init_std=0.03,
    ),
}
# The step-speed model: so small that a vLLM decode step over 64 rows takes 10-30 ms on two CPU
# cores, a GPU's order for a 7B model, so whatever a layer adds per step and per row shows (on
# bench-50m it hides behind the model). Llama, hidden 128, 3 layers, 2 heads of 64, 1 KV head,
# vocabulary 1,000, float32.
PRESETS["bench-step"] = TinyModelSpec(
    architecture="llama",
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    seed=4,
)
# About 160M parameters (0.64 GB in float32): bench-250m with half its layers, the smaller model
# of the refit benchmark.
PRESETS["bench-160m"] = dataclasses.replace(PRESETS["bench-250m"], num_hidden_layers=8)
# A mixture of experts (Qwen3-MoE: 8 experts of which each token takes 2, in each of 2 layers):
# the model routed-expert outputs are checked on.
PRESETS["tiny-qwen3-moe"] = TinyModelSpec(
    architecture="qwen3_moe", seed=3, num_experts=8, num_experts_per_tok=2
)


@dataclass(frozen=True)
class TinyModel:
    """A built model on disk: pass ``str(path)`` as ``model_name`` to any backend."""

    spec: TinyModelSpec
    path: Path

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def eos_token_id(self) -> int:
        return 2

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors by their Hugging Face names (the names weight updates use)."""
        from safetensors.torch import load_file

        return load_file(str(self.path / "model.safetensors"))


def model_cache_dir() -> Path:
    """Where built models live: ``$GEN_TESTKIT_CACHE`` or ``~/.cache/gen-testkit/models``."""
    root = os.environ.get("GEN_TESTKIT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "gen-testkit" / "models"


def build_tiny_model(
    spec: TinyModelSpec | str = "tiny-qwen2", *, cache: Path | None = None
) -> TinyModel:
    """Build (or reuse from the cache) the model directory for ``spec`` or a preset name.

    The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and a
    byte-level BPE tokenizer (ids 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``) whose vocabulary fits
    inside the model's. The build writes to a temporary directory and renames it into place, so
    concurrent builders never see a half-written model.
    """
    if isinstance(spec, str):
        try:
            spec = PRESETS[spec]
        except KeyError:
            raise ValueError(f"no tiny model preset {spec!r}; presets: {sorted(PRESETS)}") from None
    root = cache or model_cache_dir()
    target = root / spec.key
    if (target / "model.safetensors").is_file():
        return TinyModel(spec, target)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.key}-", dir=root))
    try:
        _write_model(spec, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race to a finished build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TinyModel(spec, target)


def _write_model(spec: TinyModelSpec, out: Path) -> None:
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3MoeConfig,
    )

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}
    moe = (
        {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": True,
            "head_dim": spec.hidden_size // spec.num_attention_heads,
        }
        if spec.num_experts
        else {}
    )
    config = config_cls[spec.architecture](
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
        **moe,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(_draw(spec, name, param.shape))
    model.save_pretrained(out, safe_serialization=True)
    if spec.num_experts:  # transformers writes num_local_experts; vLLM reads num_experts
        written = json.loads((out / "config.json").read_text())
        written["num_experts"] = spec.num_experts
        (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True))
    GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2).save_pretrained(out)
    _write_tokenizer(spec, out)


def _draw(spec: TinyModelSpec, name: str, shape: torch.Size) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{spec.seed}/{name}".encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.1 * noise
    return spec.init_std * noise


def _write_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(spec.vocab_size, 1024) - 16,  # room for the wrapper's extra tokens
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)


#: A small chat template (turns between ``<s>`` and ``</s>``, tool definitions as JSON), so the
#: chat routes of a server can be tested on the tiny models.
_CHAT_TEMPLATE = (
    "{% if tools %}<s>tools\n{{ tools | tojson }}</s>\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


# A fixed training text for the tokenizer's merges: any text works, it only has to be fixed.
_CORPUS = """\
Reinforcement learning from feedback samples many responses from a policy, scores them and
updates the policy towards the better ones. The generation layer turns token ids into token ids
and log-probabilities, fast, with numbers that agree across backends.
A training loop calls prepare for generation, generates a batch, finishes generation, trains,
and then pushes the new weights to every generation worker before the next round.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs.
def generate(data, greedy=False): return outputs  # code is text too: (x + y) * z [0, 1, 2]
Numbers 0123456789 and punctuation .,;:!?'"-()[]{}<>/@#$%^&*=+_~ appear in real prompts.
"""
