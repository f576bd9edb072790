"""The speculative-decoding benchmark's models: a target trained on a synthetic task, and a
drafter distilled from it. Built deterministically and cached on disk, keyed by their settings.

    uv run python tools/bench/speculative_models.py        # build (or find) them, print figures

**Task.** A first-order Markov chain over ``symbols`` token ids (``first_id`` onwards): every
symbol has ``successors`` possible next symbols, drawn at random, with probabilities
``softmax(logit_std * N(0, 1))``. Its entropy rate is a little under ``ln(successors)`` nats
(about 1.9 for 10 successors at ``logit_std`` 1), so a model that has learnt it is peaked enough
for a drafter's acceptance to mean something, yet far from deterministic.

**Target.** A Llama of the testkit's step-speed family (hidden 256, 4 layers, heads of 64, the
testkit's byte-level tokenizer and vocabulary of 1,000), its starting weights the testkit's
deterministic draw (``build_tiny_model``), trained with plain torch (Adam, cross-entropy on
sequences drawn from the chain) until its mean per-token entropy at temperature 1, measured
by teacher forcing on held-out sequences of the chain, lies in [1, 3] nats and training has run
at least ``target_steps`` steps.

**Drafter.** A Llama of one layer and hidden 128, the same vocabulary and tokenizer, distilled
from the target: forward KL ``sum_v p_target(v) (log p_target(v) - log p_drafter(v))`` over the
whole vocabulary, at every position of sequences the target sampled itself (temperature 1).

Both are Hugging Face model directories (``config.json``, ``model.safetensors``, tokenizer
files) under ``gen_testkit.models.model_cache_dir() / "speculative-<key>"``, where the key hashes
every setting; ``figures.json`` beside them holds the entropy, cross-entropy and KL reached.
Torch runs on ``threads`` threads with fixed seeds, so a given machine rebuilds the same
weights (the cache is reused whatever the machine).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gen_testkit.models import TinyModelSpec, build_tiny_model, model_cache_dir

_FORMAT = 1  # bump when the recipe changes, so old caches are not reused

#: The target: the step-speed family (bench-step is hidden 128 and 3 layers), a little larger.
TARGET = TinyModelSpec(
    architecture="llama",
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    init_std=0.02,
    seed=20,
)
#: The drafter: one layer, hidden 128, the target's vocabulary.
DRAFTER = TinyModelSpec(
    architecture="llama",
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    init_std=0.02,
    seed=21,
)

#: The entropy band the target must reach (nats per token at temperature 1).
ENTROPY_BAND = (1.0, 3.0)


@dataclass(frozen=True)
class MarkovTask:
    """The synthetic task: a first-order Markov chain over ``symbols`` ids from ``first_id``."""

    symbols: int = 256
    first_id: int = 3
    successors: int = 10
    logit_std: float = 1.0
    seed: int = 0

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a frozen dataclass: a few tables, kept)
    def transitions(self, vocab: int) -> torch.Tensor:
        """``[vocab, vocab]``: row ``a`` the distribution of the id after ``a`` (rows of ids
        outside the task are those of the task's first symbol)."""
        generator = torch.Generator().manual_seed(self.seed)
        table = torch.zeros(self.symbols, self.symbols)
        for row in range(self.symbols):
            picks = torch.randperm(self.symbols, generator=generator)[: self.successors]
            logits = self.logit_std * torch.randn(self.successors, generator=generator)
            table[row, picks] = torch.softmax(logits, 0)
        full = torch.zeros(vocab, vocab)
        ids = slice(self.first_id, self.first_id + self.symbols)
        full[:, ids] = table[0]
        full[ids, ids] = table
        return full

    def entropy_rate(self, vocab: int) -> float:
        """Nats per token of the chain at its stationary distribution."""
        table = self.transitions(vocab)[
            self.first_id : self.first_id + self.symbols,
            self.first_id : self.first_id + self.symbols,
        ]
        stationary = torch.full((self.symbols,), 1.0 / self.symbols)
        for _ in range(200):
            stationary = stationary @ table
        row_entropy = -(table * table.clamp_min(1e-30).log()).sum(1)
        return float(stationary @ row_entropy)

    def sample(self, rows: int, length: int, seed: int, vocab: int) -> torch.Tensor:
        """``[rows, length]`` sequences of the chain, the first id uniform over the symbols."""
        generator = torch.Generator().manual_seed(seed)
        table = self.transitions(vocab)
        out = torch.empty(rows, length, dtype=torch.int64)
        out[:, 0] = self.first_id + torch.randint(self.symbols, (rows,), generator=generator)
        for t in range(1, length):
            out[:, t] = torch.multinomial(table[out[:, t - 1]], 1, generator=generator)[:, 0]
        return out


@dataclass(frozen=True)
class Recipe:
    """Every setting of a build; equal recipes share a cache directory."""

    task: MarkovTask = MarkovTask()
    target: TinyModelSpec = TARGET
    drafter: TinyModelSpec = DRAFTER
    length: int = 64  # tokens per training sequence (prompts + new tokens of the bench fit)
    batch: int = 16
    target_steps: int = 150  # at least; more (up to 4x) while the entropy is outside the band
    target_lr: float = 3e-3
    drafter_samples: int = 256  # sequences the target samples for the distillation
    drafter_steps: int = 200
    drafter_lr: float = 3e-3
    threads: int = 2

    @property
    def key(self) -> str:
        blob = json.dumps({"format": _FORMAT, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Prepared:
    """A built pair: pass ``str(target)`` as ``model_name``, ``str(drafter)`` as the
    speculative ``model``."""

    recipe: Recipe
    target: Path
    drafter: Path
    figures: dict[str, Any]


def prepare(recipe: Recipe = Recipe(), *, cache: Path | None = None) -> Prepared:
    """Build (or find in the cache) the target and the drafter of ``recipe``.

    Raises:
        RuntimeError: the target's entropy did not reach ``ENTROPY_BAND`` within its steps.
    """
    root = (cache or model_cache_dir()) / f"speculative-{recipe.key}"
    if (root / "figures.json").is_file():
        figures = json.loads((root / "figures.json").read_text())
        return Prepared(recipe, root / "target", root / "drafter", figures)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".speculative-{recipe.key}-", dir=root.parent))
    try:
        figures = _build(recipe, staging, root.parent)
        (staging / "figures.json").write_text(json.dumps(figures, indent=1, sort_keys=True))
        try:
            staging.rename(root)
        except OSError:
            if not (root / "figures.json").is_file():  # lost a race to a finished build
                raise
            figures = json.loads((root / "figures.json").read_text())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Prepared(recipe, root / "target", root / "drafter", figures)


def load_model(path: Path) -> Any:
    """A directory of this module's as a float32 transformers model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def mean_entropy(model: Any, sequences: torch.Tensor, chunk: int = 64) -> tuple[float, float]:
    """(mean per-token entropy at temperature 1, mean cross-entropy) of ``model`` over every
    next-token position of ``sequences``, in nats."""
    entropies, losses = [], []
    with torch.no_grad():
        for part in sequences.split(chunk):
            logprobs = torch.log_softmax(model(input_ids=part).logits[:, :-1].float(), -1)
            entropies.append(-(logprobs.exp() * logprobs).sum(-1).flatten())
            losses.append(-logprobs.gather(2, part[:, 1:, None])[..., 0].flatten())
    return float(torch.cat(entropies).mean()), float(torch.cat(losses).mean())


def _build(recipe: Recipe, out: Path, cache: Path) -> dict[str, Any]:
    """Train and distil into ``out``; the starting weights come from ``cache``."""
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(0)
    vocab = recipe.target.vocab_size
    task = recipe.task
    held_out = task.sample(64, recipe.length, seed=10**6, vocab=vocab)
    start = time.perf_counter()

    target = load_model(build_tiny_model(recipe.target, cache=cache).path)
    optimizer = torch.optim.Adam(target.parameters(), lr=recipe.target_lr)
    entropy = loss = float("nan")
    step = 0
    while step < 4 * recipe.target_steps:
        batch = task.sample(recipe.batch, recipe.length, seed=step, vocab=vocab)
        logits = target(input_ids=batch).logits[:, :-1]
        train_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), batch[:, 1:].flatten()
        )
        optimizer.zero_grad()
        train_loss.backward()
        optimizer.step()
        step += 1
        if step % 25 == 0:
            entropy, loss = mean_entropy(target, held_out)
            print(
                f"target step {step}: train CE {train_loss.item():.3f}, held-out entropy "
                f"{entropy:.3f}, CE {loss:.3f} nats ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            low, high = ENTROPY_BAND
            if step >= recipe.target_steps and low <= entropy <= high:
                break
    else:
        raise RuntimeError(
            f"the target's held-out entropy is {entropy:.3f} nats after {step} steps, outside "
            f"{ENTROPY_BAND}: change the task (successors, logit_std) or train longer"
        )
    target.eval()
    save_model(target, build_tiny_model(recipe.target, cache=cache).path, out / "target")

    samples = _sample(target, task, recipe)
    with torch.no_grad():
        teacher = torch.cat(
            [
                torch.log_softmax(target(input_ids=p).logits[:, :-1].float(), -1)
                for p in samples.split(64)
            ]
        )
    drafter = load_model(build_tiny_model(recipe.drafter, cache=cache).path)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=recipe.drafter_lr)
    generator = torch.Generator().manual_seed(1)
    for drafter_step in range(1, recipe.drafter_steps + 1):
        rows = torch.randint(len(samples), (recipe.batch,), generator=generator)
        kl = forward_kl(drafter, samples[rows], teacher[rows])
        optimizer.zero_grad()
        kl.backward()
        optimizer.step()
        if drafter_step % 50 == 0:
            print(
                f"drafter step {drafter_step}: forward KL {kl.item():.4f} nats "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    drafter.eval()
    with torch.no_grad():
        held_kl = float(forward_kl(drafter, samples[:64], teacher[:64]))
    drafter_entropy, drafter_loss = mean_entropy(drafter, held_out)
    save_model(drafter, build_tiny_model(recipe.drafter, cache=cache).path, out / "drafter")
    return {
        "task_entropy_rate": task.entropy_rate(vocab),
        "target_steps": step,
        "target_entropy": entropy,
        "target_cross_entropy": loss,
        "drafter_forward_kl": held_kl,
        "drafter_entropy": drafter_entropy,
        "drafter_cross_entropy": drafter_loss,
        "build_seconds": time.perf_counter() - start,
    }


def forward_kl(student: Any, sequences: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over next-token positions of ``KL(teacher || student)``, whole vocabulary;
    ``teacher``: ``[rows, length - 1, vocab]`` log-probabilities for ``sequences``."""
    logprobs = torch.log_softmax(student(input_ids=sequences).logits[:, :-1].float(), -1)
    return (teacher.exp() * (teacher - logprobs)).sum(-1).mean()


def _sample(model: Any, task: MarkovTask, recipe: Recipe) -> torch.Tensor:
    """``drafter_samples`` sequences of ``length`` ids the model samples at temperature 1 after
    one id of the chain."""
    torch.manual_seed(2)
    firsts = task.sample(recipe.drafter_samples, 1, seed=2, vocab=recipe.target.vocab_size)
    out = []
    with torch.no_grad():
        for part in firsts.split(128):
            out.append(
                model.generate(
                    part,
                    attention_mask=torch.ones_like(part),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=recipe.length - 1,
                    min_new_tokens=recipe.length - 1,
                    pad_token_id=0,
                )
            )
    return torch.cat(out)


def save_model(model: Any, init: Path, out: Path) -> None:
    """Write ``model`` to ``out`` as a Hugging Face directory: its weights and config, and the
    tokenizer files of the directory ``init``."""
    model.save_pretrained(out, safe_serialization=True)
    for path in init.iterdir():
        if path.name not in {"config.json", "model.safetensors"} and path.is_file():
            shutil.copy(path, out / path.name)


if __name__ == "__main__":
    prepared = prepare()
    print(f"target {prepared.target}\ndrafter {prepared.drafter}")
    print(json.dumps(prepared.figures, indent=1))
