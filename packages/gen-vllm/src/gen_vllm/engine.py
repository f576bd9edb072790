"""The engine a worker drives: the part of vLLM's ``LLMEngine`` this backend uses, as a protocol.

``VllmEngine`` is the real one: a v1 ``LLMEngine`` in the worker's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by ``EngineLoop`` on one thread. vLLM's
``AsyncLLM`` would run the same engine core in a second process, which costs a second start of
torch and vLLM (measured on 2 cores, before the environment was compiled to bytecode: first token
after 51-60 s against 27-31 s for the in-process engine), so the asynchronous core is built on
the in-process engine and vLLM's own primitives: per-request outputs, ``abort_request``,
``pause_scheduler(mode="keep")``, weight versions.

Tests drive ``EngineLoop`` and the workers with a fake that follows this protocol and vLLM's
documented contracts where the CPU build cannot (sleep mode, tensor-parallel ranks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

from gen_vllm.messages import TokenDelta

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

__all__ = [
    "EXTENSION_CLASS",
    "EngineFactory",
    "EngineLimits",
    "EngineProtocol",
    "EngineStep",
    "StepOutput",
    "VllmEngine",
]

#: vLLM imports this in every worker; importing ``gen_vllm.transfer`` registers its engine.
EXTENSION_CLASS = "gen_vllm.transfer.UpdatableVllmInternalWorker"


@dataclass(frozen=True)
class EngineLimits:
    """What the engine accepts: token ids below ``vocab_size``, sequences up to
    ``max_model_len`` tokens, weights in ``dtype``."""

    vocab_size: int
    max_model_len: int
    dtype: str
    model: str


@dataclass(frozen=True)
class StepOutput:
    """One request's end: its result, with every token it generated, reported once, when it
    finishes or is aborted.

    Attributes:
        request_id: the request's id.
        token_ids: every token the row generated.
        logprobs: their log-probabilities.
        finish_reason: None while the request runs; why it ended once it did, as vLLM says it
            (``"stop"``, ``"length"``, ``"abort"``, or another reason such as ``"error"``,
            which fails the row).
        prompt_logprobs: for requests that asked for them, the log-probability of prompt token
            t given tokens before it, for t >= 1 (``[len(prompt) - 1]``); reported once.
        topk_ids, topk_logprobs: for requests that asked for ``logprobs=k`` with k >= 1, per
            token, the k likeliest tokens and their logprobs, most likely first.
        prompt_topk_ids, prompt_topk_logprobs: the same for prompt tokens t >= 1, for requests
            that asked for ``prompt_logprobs=k`` with k >= 1.
        cached_tokens: once the request finished, how many of its prompt tokens vLLM found in
            its prefix cache (``RequestOutput.num_cached_tokens``); None before.
        routed_experts: once the request finished, with vLLM's own routed-experts option
            (GPU): int ``[positions read, layers, top_k]`` (``CompletionOutput.routed_experts``);
            None otherwise.
        weight_versions: the weight version that produced each of ``token_ids`` (vLLM's own
            spans), or None: all from the weights in force now.
        speculation: once the request ended, with speculative decoding on, its
            ``(drafts, proposed, accepted)``: verifying steps that had draft tokens, the draft
            tokens proposed, and of them the ones accepted (vLLM's per-request summary); None
            otherwise.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_logprobs: list[float] | None = None
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    prompt_topk_ids: list[list[int]] | None = None
    prompt_topk_logprobs: list[list[float]] | None = None
    cached_tokens: int | None = None
    routed_experts: Any = None
    weight_versions: list[int] | None = None
    speculation: tuple[int, int, int] | None = None


class EngineStep(NamedTuple):
    """What one engine step produced: ``deltas``, the new tokens of each request that streams
    and advanced without ending; ``ended``, each request that ended (its tokens of this step
    included, never in ``deltas``); ``finished_at``, when the engine finished the step's
    forward pass and sampling (``time.time()``; vLLM's own stamp on its core outputs, taken
    before it builds any output), or None where the engine has no such stamp (the loop then
    takes the time the step returned)."""

    deltas: list[TokenDelta]
    ended: list[StepOutput]
    finished_at: float | None = None


class EngineProtocol(Protocol):
    """The engine operations ``EngineLoop`` calls, always from one thread."""

    limits: EngineLimits

    def add_request(
        self, request_id: str, prompt: list[int], params: dict[str, Any], stream: bool = False
    ) -> None:
        """Queue a request; ``params`` are ``SamplingParams`` keyword arguments. It reports its
        result when it ends; with ``stream``, every earlier step's new tokens too."""

    def step(self) -> EngineStep:
        """Run one scheduling step: the streaming requests' new tokens and the ends."""

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        """Drop requests; they produce no further output. Returns, for each request that was
        still running, its final output: finish reason ``"abort"``, every token it had
        generated and its ``speculation`` so far."""

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call a worker-extension method on every tensor-parallel rank; results in rank order."""

    def reset_prefix_cache(self) -> bool:
        """Drop cached KV of finished prompts; False while requests still hold blocks."""

    def sleep(self, level: int) -> None:
        """vLLM sleep mode (CUDA): level 1 offloads weights and drops the KV cache; level 2
        drops both."""

    def wake_up(self, tags: list[str] | None) -> None:
        """Bring back ``"weights"`` and/or ``"kv_cache"`` (all when None)."""

    def pause(self) -> None:
        """Stop scheduling and free running requests' KV: they recompute it on resume
        (vLLM's ``pause_scheduler(mode="keep", clear_cache=True)``)."""

    def resume(self) -> None:
        """Resume scheduling after ``pause``."""

    def add_lora(self, fields: dict[str, Any]) -> None:
        """Serve the adapter ``LoRARequest(**fields)`` names (``load_inplace``: replace the one
        of its id, running rows included)."""

    def set_weight_version(self, version: int) -> None:
        """Label the weights that produce the next tokens."""

    def shutdown(self) -> None:
        """Free the engine."""


#: Builds an engine from the model name and ``vllm.EngineArgs`` keyword arguments, in the worker.
EngineFactory = Callable[[str, dict[str, Any]], EngineProtocol]


class VllmEngine:
    """A vLLM v1 ``LLMEngine`` in this process, with this project's worker extension.

    Every row is added with ``FINAL_ONLY`` outputs and flat logprobs, so vLLM builds nothing per
    step for any row and this class reads each one once, when it ends, from flat lists: the
    sampled token's logprob, its top-k and the weight version of every token (vLLM's own spans,
    labelled by ``set_weight_version``). A row that streams reports each step's new tokens from
    the engine core's own outputs for that step (``_step_deltas``). Built as vLLM's ``DELTA``
    outputs (which ``AsyncLLM`` builds in another process) and read row by row, they took 20%
    of a step over 256 streaming rows on this engine's thread; read this way, 5%.
    """

    def __init__(self, model: str, engine_args: dict[str, Any]):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=model, worker_extension_cls=EXTENSION_CLASS, **engine_args)
        self._engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)
        self._engine.set_weight_version("0")  # every token carries a version from the start
        # the engine core's outputs of the last step, for the rows that stream, and their
        # stamp (``time.monotonic()`` as the scheduler took the step's results)
        self._core_outputs: list[Any] = []
        self._core_stamp: float | None = None
        core = self._engine.engine_core
        fetch = core.get_output

        def tapped() -> Any:
            outputs = fetch()
            self._core_outputs = outputs.outputs
            self._core_stamp = outputs.timestamp
            return outputs

        core.get_output = tapped  # type: ignore[method-assign]
        # each running request's (top logprobs, top prompt logprobs)
        self._requests: dict[str, tuple[int, int]] = {}
        self._streams: set[str] = set()  # the running requests that stream
        config = self._engine.model_config
        self.limits = EngineLimits(
            vocab_size=config.get_vocab_size(),
            max_model_len=config.max_model_len,
            dtype=str(config.dtype).removeprefix("torch."),
            model=model,
        )

    def add_request(
        self, request_id: str, prompt: list[int], params: dict[str, Any], stream: bool = False
    ) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = dict(params)
        adapter = params.pop("lora_request", None)  # LoRARequest fields: the adapter served
        sampling = SamplingParams(
            **params, output_kind=RequestOutputKind.FINAL_ONLY, flat_logprobs=True
        )
        self._engine.add_request(
            request_id,
            {"prompt_token_ids": prompt},
            sampling,
            lora_request=None if adapter is None else _lora_request(adapter),
        )
        self._requests[request_id] = (
            int(params.get("logprobs") or 0),
            int(params.get("prompt_logprobs") or 0),
        )
        if stream:
            self._streams.add(request_id)

    def step(self) -> EngineStep:
        self._core_outputs, self._core_stamp = [], None
        ended = [self._step_output(r) for r in cast("list[RequestOutput]", self._engine.step())]
        stamp = self._core_stamp
        finished_at = None if stamp is None else time.time() - (time.monotonic() - stamp)
        if not self._streams:
            return EngineStep([], ended, finished_at)
        return EngineStep(self._step_deltas({e.request_id for e in ended}), ended, finished_at)

    def _step_deltas(self, ended: set[str]) -> list[TokenDelta]:
        """This step's new tokens of each streaming row that did not end in it (an ending
        row's come whole with its result), from the engine core's outputs: each one's new
        token ids and its ``LogprobsLists`` ``[new tokens, 1 + the batch's most top-k]``, the
        sampled token's first, then ranks 1 .. k."""
        states = self._engine.output_processor.request_states
        deltas = []
        for core in self._core_outputs:
            tokens = core.new_token_ids
            state = states.get(core.request_id) if tokens else None
            if state is None:  # no new tokens, ended (its state is gone) or aborted
                continue
            request_id = state.external_req_id
            if request_id in ended or request_id not in self._streams:
                continue
            logprobs: list[float] = []
            topk_ids: list[list[int]] = []
            topk_logprobs: list[list[float]] = []
            if core.new_logprobs is not None:
                ids, values = core.new_logprobs.logprob_token_ids, core.new_logprobs.logprobs
                if ids[:, 0].tolist() != tokens:
                    from gen_interface import GenerationError

                    raise GenerationError(f"vLLM returned no logprobs for tokens {tokens}")
                logprobs = values[:, 0].tolist()
                k = self._requests[request_id][0]
                if k:
                    topk_ids = ids[:, 1 : 1 + k].tolist()
                    topk_logprobs = values[:, 1 : 1 + k].tolist()
            deltas.append(TokenDelta(request_id, list(tokens), logprobs, topk_ids, topk_logprobs))
        return deltas

    def _step_output(self, request: RequestOutput) -> StepOutput:
        completion = request.outputs[0]
        k, prompt_k = self._requests.get(request.request_id, (0, 0))
        if request.finished:
            self._requests.pop(request.request_id, None)
            self._streams.discard(request.request_id)
        tokens = list(completion.token_ids)
        logprobs, topk_ids, topk_logprobs = _sampled(completion.logprobs, tokens, k)
        prompt_logprobs = prompt_topk_ids = prompt_topk_logprobs = None
        if request.prompt_logprobs is not None:
            prompt = list(request.prompt_token_ids or [])
            prompt_logprobs, prompt_topk_ids, prompt_topk_logprobs = _sampled(
                request.prompt_logprobs, prompt, prompt_k, first=1
            )
        return StepOutput(
            request_id=request.request_id,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=(completion.finish_reason or "unknown") if request.finished else None,
            prompt_logprobs=prompt_logprobs,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            prompt_topk_ids=prompt_topk_ids if prompt_k else None,
            prompt_topk_logprobs=prompt_topk_logprobs if prompt_k else None,
            cached_tokens=int(request.num_cached_tokens or 0) if request.finished else None,
            routed_experts=completion.routed_experts if request.finished else None,
            weight_versions=_versions(completion.weight_versions, len(tokens)),
            speculation=_speculation(completion.spec_decode_metrics) if request.finished else None,
        )

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        from vllm.v1.engine import FinishReason

        processor = self._engine.output_processor
        finals = []
        for request_id in request_ids:
            for internal in processor.external_req_ids.get(request_id, []):
                state = processor.request_states.get(internal)
                if state is None:
                    continue
                # vLLM attaches a request's acceptance to its last engine output only: an
                # aborted one's is read from the scheduler, which still holds the request
                scheduled = self._core().scheduler.requests.get(internal)
                if scheduled is not None and scheduled.spec_decode_metrics is not None:
                    state.spec_decode_metrics = scheduled.spec_decode_metrics
                output = state.make_request_output([], None, FinishReason.ABORT, None)
                if output is not None:
                    finals.append(self._step_output(cast("RequestOutput", output)))
        self._engine.abort_request(request_ids)
        for request_id in request_ids:
            self._requests.pop(request_id, None)
            self._streams.discard(request_id)
        return finals

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return list(self._engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self._engine.reset_prefix_cache())

    def sleep(self, level: int) -> None:
        self._engine.sleep(level=level)

    def wake_up(self, tags: list[str] | None) -> None:
        self._engine.wake_up(tags=tags)

    def pause(self) -> None:
        self._core().pause_scheduler(mode="keep", clear_cache=True)

    def resume(self) -> None:
        self._core().resume_scheduler()

    def add_lora(self, fields: dict[str, Any]) -> None:
        self._engine.add_lora(_lora_request(fields))

    def set_weight_version(self, version: int) -> None:
        self._engine.set_weight_version(str(version))

    def shutdown(self) -> None:
        self._engine.engine_core.shutdown()

    def _core(self) -> Any:
        """The in-process ``EngineCore`` (``LLMEngine`` exposes pause only on ``AsyncLLM``)."""
        return cast(Any, self._engine.engine_core).engine_core


def _sampled(
    flat: Any, tokens: list[int], k: int, first: int = 0
) -> tuple[list[float], list[list[int]] | None, list[list[float]] | None]:
    """The logprob of each of ``tokens[first:]`` and, with ``k``, the k likeliest tokens and
    their logprobs at each of those positions, from vLLM's flat logprobs (``FlatLogprobs``:
    per position, the chosen token's entry, then ranks 1 .. k); nothing when none were asked.

    Raises:
        GenerationError: vLLM's entry at a position is not the token's.
    """
    if flat is None:  # not asked for (a scoring request's one token)
        return [], ([] if k else None), ([] if k else None)
    starts, values, ids = flat.start_indices, flat.logprobs, flat.token_ids
    # Every position holds 1 + k entries (vLLM's usual layout): whole-list slices and one
    # comparison, not a lookup per position (64 rows of 128 tokens: 0.3 ms less at their end).
    width, count = 1 + k, len(tokens) - first
    if (
        len(ids) == width * count
        and starts[first:] == list(range(0, width * count, width))
        and ids[::width] == tokens[first:]
    ):
        if not k:
            return values[:], None, None
        return (
            values[::width],
            [ids[i + 1 : i + width] for i in range(0, width * count, width)],
            [values[i + 1 : i + width] for i in range(0, width * count, width)],
        )
    picked = range(first, len(tokens))
    for t in picked:
        if ids[starts[t]] != tokens[t]:
            from gen_interface import GenerationError

            raise GenerationError(f"vLLM returned no logprob for token {tokens[t]}")
    logprobs = [values[starts[t]] for t in picked]
    if not k:
        return logprobs, None, None
    return (
        logprobs,
        [ids[starts[t] + 1 : starts[t] + 1 + k] for t in picked],
        [values[starts[t] + 1 : starts[t] + 1 + k] for t in picked],
    )


def _versions(spans: Any, count: int) -> list[int] | None:
    """Each token's weight version from vLLM's ``WeightVersionSpan``s (None when absent)."""
    if spans is None:
        return None
    versions = [0] * count
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    return versions


def _speculation(metrics: Any) -> tuple[int, int, int] | None:
    """``(drafts, proposed, accepted)`` from vLLM's ``RequestSpecDecodeMetrics`` (None when
    speculation is off): ``histogram[j]`` verifying steps accepted j draft tokens."""
    if metrics is None:
        return None
    histogram = list(metrics.histogram)
    accepted = sum(j * count for j, count in enumerate(histogram))
    return sum(histogram), int(metrics.num_draft_tokens), accepted


def _lora_request(fields: dict[str, Any]) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(**fields)
