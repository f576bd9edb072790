"""Per-row sampling, resolved once per call: every backend samples each row from one plain record.

A call's sampling comes from three places: the config (or a ``with_sampling`` front end's
overrides), the call's ``greedy`` flag, and the batch's own per-row entries (``sample_seeds``,
``stop_strings``, and any of the per-row settings of ``row_settings``, which replace the
config's for their row). ``resolve_sampling`` folds them into a ``BatchSampling``: one
``RowSampling`` per row, every setting explicit, seeds already derived. Backends read nothing
else, so they cannot disagree on what a setting means, and the record crosses a process or a
network as plain data (``to_wire`` / ``from_wire``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

from gen_interface.config import sampling_settings_of
from gen_interface.errors import GenerationInputError
from gen_interface.seeds import MAX_SEED, derive_row_seeds, row_seed
from gen_interface.specs import GenerationConfig, LogprobsMode

from gen_backend_kit.inputs import PromptBatch

__all__ = [
    "GREEDY_TEMPERATURE",
    "BatchSampling",
    "GenerationCall",
    "RowSampling",
    "is_greedy",
    "resolve_sampling",
    "row_seeds_for",
]

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing by them overflows.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(temperature: float, greedy: bool) -> bool:
    """True when a generate call takes the argmax: ``greedy=True`` or a temperature of ~0."""
    return greedy or temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class RowSampling:
    """How one row is generated, every setting resolved.

    Attributes:
        max_new_tokens: the most tokens the row generates (>= 1).
        temperature: 0.0 means greedy (argmax; logprobs reported raw); else > 0.
        top_k: None (off) or >= 1.
        top_p: in (0, 1]; 1.0 is off.
        stop_token_ids: ids that end the row (kept in its output).
        stop_strings: strings that end the row once its generated text contains one (kept).
        seed: the row's 64-bit sampling seed; a row draws only from a generator seeded with it.
        min_p: in [0, 1]; tokens less likely than ``min_p`` times the likeliest are dropped
            (after temperature, before top-k); 0.0 is off.
        top_logprobs: how many of the likeliest tokens to report at each step, with their
            logprobs (in the call's logprobs mode); 0 is off.
    """

    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    seed: int
    min_p: float = 0.0
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class BatchSampling:
    """The sampling of every row of one call, in input order.

    Attributes:
        rows: one ``RowSampling`` per row.
        logprobs_mode: ``"raw"`` or ``"processed"`` (greedy rows report raw values either way).
    """

    rows: tuple[RowSampling, ...]
    logprobs_mode: LogprobsMode = "raw"

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def processed(self) -> bool:
        return self.logprobs_mode == "processed"

    @property
    def max_top_logprobs(self) -> int:
        """The most top logprobs any row asks for: the ``K`` of the outputs' top-k fields."""
        return max((row.top_logprobs for row in self.rows), default=0)

    @property
    def needs_tokenizer(self) -> bool:
        """Some row has stop strings, which only a backend with a tokenizer can honour."""
        return any(row.stop_strings for row in self.rows)

    def select(self, indices: Sequence[int]) -> BatchSampling:
        """The rows at ``indices``, in that order."""
        return BatchSampling(tuple(self.rows[i] for i in indices), self.logprobs_mode)

    def to_wire(self) -> dict[str, Any]:
        """JSON-ready columns: ``{"logprobs_mode": ..., "<field>": [one value per row]}``."""
        wire: dict[str, Any] = {"logprobs_mode": self.logprobs_mode}
        for f in fields(RowSampling):
            values = [getattr(row, f.name) for row in self.rows]
            wire[f.name] = [list(v) if isinstance(v, tuple) else v for v in values]
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> BatchSampling:
        """Rebuild what ``to_wire`` wrote, checking every value.

        Raises:
            GenerationInputError: a column is missing, of another length, or holds a value
                out of range; the message names the column and the row.
        """
        mode = wire.get("logprobs_mode")
        if mode not in ("raw", "processed"):
            raise GenerationInputError(f"sampling logprobs_mode must be raw or processed: {mode!r}")
        names = [f.name for f in fields(RowSampling)]
        columns = {name: wire.get(name) for name in names}
        missing = [n for n, v in columns.items() if not isinstance(v, list)]
        if missing:
            raise GenerationInputError(f"sampling columns {missing} are missing or not lists")
        counts = {len(cast(list[Any], v)) for v in columns.values()}
        if len(counts) != 1:
            raise GenerationInputError(f"sampling columns differ in length: {sorted(counts)}")
        rows = []
        for i in range(counts.pop()):
            row = {name: cast(list[Any], columns[name])[i] for name in names}
            rows.append(_checked_row(i, row))
        return cls(tuple(rows), cast(LogprobsMode, mode))


def resolve_sampling(
    config: GenerationConfig | Mapping[str, Any], prompts: PromptBatch, *, greedy: bool
) -> BatchSampling:
    """Every row's sampling for one call of a backend configured with ``config``.

    A row's own settings (``prompts.row_settings``) replace the config's. Greedy rows
    (``greedy=True``, or a temperature below ``GREEDY_TEMPERATURE``) get temperature 0.0. A row's
    stop strings are the config's then its own, without repeats; its seed is the caller's
    ``sample_seeds`` entry (mixed) or derived from the config seed and its index.
    """
    temperature, top_k, top_p = sampling_settings_of(cast(GenerationConfig, config))
    defaults: dict[str, Any] = {
        "max_new_tokens": int(config["max_new_tokens"]),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": float(config.get("min_p", 0.0)),
        "top_logprobs": int(config.get("top_logprobs", 0)),
        "stop_token_ids": list(config.get("stop_token_ids") or ()),
    }
    own = prompts.row_settings
    common_strings = list(config.get("stop_strings") or [])
    seeds = row_seeds_for(prompts, config.get("seed"))
    rows = []
    for i, (strings, seed) in enumerate(zip(prompts.stop_strings, seeds)):
        value = {k: (own[k][i] if k in own else v) for k, v in defaults.items()}
        if value["stop_token_ids"] is None:  # this row keeps the config's
            value["stop_token_ids"] = defaults["stop_token_ids"]
        if value["top_k"] is not None and value["top_k"] < 1:  # 0 and -1 mean off
            value["top_k"] = None
        rows.append(
            RowSampling(
                max_new_tokens=value["max_new_tokens"],
                temperature=0.0
                if is_greedy(value["temperature"], greedy)
                else float(value["temperature"]),
                top_k=value["top_k"],
                top_p=float(value["top_p"]),
                stop_token_ids=tuple(value["stop_token_ids"]),
                stop_strings=tuple(dict.fromkeys(common_strings + list(strings or []))),
                seed=seed,
                min_p=float(value["min_p"]),
                top_logprobs=value["top_logprobs"],
            )
        )
    return BatchSampling(tuple(rows), cast(LogprobsMode, config.get("logprobs_mode", "raw")))


def row_seeds_for(prompts: PromptBatch, base_seed: int | None) -> list[int]:
    """The seed of every row: ``row_seed`` of the caller's ``sample_seeds`` entry when given,
    else derived from the call's seed (``gen_interface.seeds``)."""
    if prompts.sample_seeds is not None:
        return [row_seed(int(s) & MAX_SEED) for s in prompts.sample_seeds.tolist()]
    return derive_row_seeds(base_seed, prompts.size)


def _checked_row(i: int, row: dict[str, Any]) -> RowSampling:
    def bad(name: str, allowed: str) -> GenerationInputError:
        return GenerationInputError(
            f"sampling row {i}: {name} must be {allowed}, got {row[name]!r}"
        )

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not is_int(row["max_new_tokens"]) or row["max_new_tokens"] < 1:
        raise bad("max_new_tokens", "an integer >= 1")
    temperature = row["temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise bad("temperature", "a number >= 0")
    if row["top_k"] is not None and (not is_int(row["top_k"]) or row["top_k"] < 1):
        raise bad("top_k", "null or an integer >= 1")
    top_p = row["top_p"]
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise bad("top_p", "in (0, 1]")
    ids = row["stop_token_ids"]
    if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
        raise bad("stop_token_ids", "a list of token ids")
    strings = row["stop_strings"]
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise bad("stop_strings", "a list of non-empty strings")
    if not is_int(row["seed"]) or not 0 <= row["seed"] <= MAX_SEED:
        raise bad("seed", f"an integer in [0, {MAX_SEED}]")
    min_p = row["min_p"]
    if isinstance(min_p, bool) or not isinstance(min_p, int | float) or not 0 <= min_p <= 1:
        raise bad("min_p", "in [0, 1]")
    if not is_int(row["top_logprobs"]) or row["top_logprobs"] < 0:
        raise bad("top_logprobs", "an integer >= 0")
    return RowSampling(
        max_new_tokens=row["max_new_tokens"],
        temperature=float(temperature),
        top_k=row["top_k"],
        top_p=float(top_p),
        stop_token_ids=tuple(ids),
        stop_strings=tuple(strings),
        seed=row["seed"],
        min_p=float(min_p),
        top_logprobs=row["top_logprobs"],
    )


@dataclass(frozen=True)
class GenerationCall:
    """One validated generate call: the prompts and how every row is sampled.

    Attributes:
        prompts: the canonical batch (``normalize_generation_input``).
        sampling: one ``RowSampling`` per row, in input order.
    """

    prompts: PromptBatch
    sampling: BatchSampling

    @property
    def size(self) -> int:
        return self.prompts.size
