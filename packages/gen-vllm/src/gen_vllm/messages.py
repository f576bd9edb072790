"""The plain data that crosses the Ray boundary between ``VllmGeneration`` and its workers.

Only ints, floats, strings, lists, dicts and numpy arrays, so nothing depends on pickling vLLM
or torch types. A worker's stream sends each ``StepBatch`` in the columnar wire form of
``gen_vllm.wire``; the driver gets finished rows back in ``RowOutput.packed`` form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import numpy as np
from gen_backend_kit import FinishReason

__all__ = [
    "RowFailure",
    "RowOutput",
    "RowRequest",
    "ScoredTokens",
    "StepBatch",
    "TokenDelta",
    "UpdateReport",
    "WorkerInfo",
]


@dataclass(frozen=True)
class RowRequest:
    """One prompt to complete.

    Attributes:
        request_id: unique among the requests in flight on a worker.
        prompt: the prompt's token ids.
        params: ``vllm.SamplingParams`` keyword arguments (see ``params.row_sampling_params``).
        stream: report the row's new tokens step by step, not only its result at its end.
        session: the conversation the row continues (the router's affinity key), or None.
    """

    request_id: str
    prompt: list[int]
    params: dict[str, Any]
    stream: bool = False
    session: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one streaming row, from one engine step.

    Attributes:
        request_id: the row's request.
        token_ids: the tokens.  # [n]
        logprobs: their log-probabilities.  # [n]
        topk_ids, topk_logprobs: per token, the row's top logprobs (empty when it asked for
            none).  # [n][k]
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass
class RowOutput:
    """One finished (or cut-short) row.

    Attributes:
        token_ids: the generated tokens.  # [g]
        logprobs: the log-probability of each, in the engine's logprobs mode.  # [g]
        finish_reason: why the row ended (``gen_interface.FinishReason``); None until it ends.
        weight_versions: the weight version that produced each token.  # [g]
        prompt_logprobs: for scoring requests, the raw log-probability of each prompt token
            after the first given the tokens before it.  # [p - 1]
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    weight_versions: list[int] = field(default_factory=list)
    weight_version: int = 0  # the version the row started on
    prompt_logprobs: list[float] | None = None
    topk_ids: list[list[int]] | None = None  # [g][k], when the row asked for top logprobs
    topk_logprobs: list[list[float]] | None = None  # [g][k]
    prompt_topk_ids: list[list[int]] | None = None  # [p - 1][k], scoring requests with top-k
    prompt_topk_logprobs: list[list[float]] | None = None  # [p - 1][k]
    cached_tokens: int = 0  # prompt tokens found in the engine's prefix cache
    # with return_routed_experts: [positions read, layers, top_k] in the wire dtype
    # (gen_vllm.routing.read_routing)
    routed_experts: bytes | None = None
    # speculative decoding: (verifying steps with drafts, draft tokens proposed, of them
    # accepted) over the row's life; zeros when speculation is off
    speculation: tuple[int, int, int] = (0, 0, 0)

    def packed(self) -> RowOutput:
        """This row with its per-token fields as numpy arrays: ``token_ids`` and
        ``weight_versions`` int64 ``[g]``, ``logprobs`` float32 ``[g]`` (vLLM's values are
        float32: nothing is lost), ``topk_ids`` int64 and ``topk_logprobs`` float32 ``[g, k]``.
        ``unpacked`` gives the lists back."""
        count = len(self.token_ids)
        return dataclasses.replace(
            self,
            token_ids=np.asarray(self.token_ids, dtype=np.int64),  # type: ignore[arg-type]
            logprobs=np.asarray(self.logprobs, dtype=np.float32),  # type: ignore[arg-type]
            weight_versions=np.asarray(self.weight_versions, dtype=np.int64),  # type: ignore[arg-type]
            topk_ids=None
            if self.topk_ids is None
            else np.asarray(self.topk_ids, dtype=np.int64).reshape(count, -1),  # type: ignore[arg-type]
            topk_logprobs=None
            if self.topk_logprobs is None
            else np.asarray(self.topk_logprobs, dtype=np.float32).reshape(count, -1),  # type: ignore[arg-type]
        )

    def unpacked(self) -> RowOutput:
        """This row with lists again where ``packed`` made arrays."""

        def listed(value: Any) -> Any:
            return value.tolist() if isinstance(value, np.ndarray) else value

        return dataclasses.replace(
            self,
            token_ids=listed(self.token_ids),
            logprobs=listed(self.logprobs),
            weight_versions=listed(self.weight_versions),
            topk_ids=listed(self.topk_ids),
            topk_logprobs=listed(self.topk_logprobs),
        )


@dataclass(frozen=True)
class RowFailure:
    """A row that ended without a result.

    Attributes:
        request_id: the row's request.
        message: what went wrong.
        engine_failed: the engine itself failed (its state is unknown: the backend is broken),
            not only this row.
    """

    request_id: str
    message: str
    engine_failed: bool = False


@dataclass
class StepBatch:
    """What a worker's engine produced since its last batch: usually one engine step, more
    when the driver fell behind. One message for every row, whatever their number.

    Attributes:
        deltas: new tokens of the rows that stream, in step order.
        finished: each row that ended, with its whole result.
        failed: each row that ended without one.
        ended: when the engine finished the batch's last step, as vLLM stamps its core
            outputs before it builds any output from them (``time.time()``, comparable across
            the machines of a cluster whose clocks are synchronised): what the driver measures
            its delivery from, the point bare vLLM's own delivery is measured from too.
        steps: engine steps since the previous batch, and ``step_seconds`` the time they took:
            how busy the engine is, beside how long delivery takes.
    """

    deltas: list[TokenDelta] = field(default_factory=list)
    finished: list[tuple[str, RowOutput]] = field(default_factory=list)
    failed: list[RowFailure] = field(default_factory=list)
    ended: float = 0.0
    steps: int = 0
    step_seconds: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.deltas or self.finished or self.failed)


class ScoredTokens(TypedDict):
    """One scored sequence's response positions."""

    logprobs: list[float]  # [g]: each response token's raw logprob
    topk_ids: list[list[int]]  # [g][k] (empty lists when k = 0)
    topk_logprobs: list[list[float]]  # [g][k]
    routed_experts: bytes | None  # every position's routing, as RowOutput's (None: not asked)


class WorkerInfo(TypedDict):
    """What a worker reports once its engine is up."""

    pid: int
    host: str
    node_id: str  # the Ray node its process runs on (shared memory reaches only that node)
    device_ids: list[str]  # one per tensor-parallel rank, in rank order
    vocab_size: int
    max_model_len: int
    dtype: str
    startup_seconds: float
    checkpoint_specs: dict[str, tuple[list[int], str]]
    optional_weights: list[str]
    # the drafter model's tensors (speculative method "draft_model"), "drafter." names; else {}
    drafter_specs: dict[str, tuple[list[int], str]]
    drafter_optional: list[str]  # of those, the ones an update may omit (a tied lm_head)


class UpdateReport(TypedDict):
    """One tensor-parallel rank's account of a weight update."""

    rank: int
    device_id: str
    received_checksum: int  # of the buckets read (the same on every rank reading one kind of copy)
    # of this rank's parameters after loading (its own shard); None when no other replica
    # compares it (one replica)
    model_checksum: int | None
    # of what this rank's packed layers compute on a fixed input (CPU: weights that no parameter
    # holds after packing); None when no layer is packed (GPU) or with one replica
    packed_checksum: int | None
    kernel: str  # what the packed results depend on: CPU model and thread count ("" on GPU)
    # of the drafter model's parameters and packed layers together (speculative method
    # "draft_model"); None without a drafter model or with one replica. Kernel-dependent like
    # packed_checksum: compared between ranks of the same kernel only.
    drafter_checksum: NotRequired[int | None]
