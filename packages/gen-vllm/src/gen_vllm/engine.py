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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

__all__ = [
    "EXTENSION_CLASS",
    "EngineFactory",
    "EngineLimits",
    "EngineProtocol",
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
    """What one engine step produced for one request.

    Attributes:
        request_id: the request's id.
        token_ids: tokens generated in this step (usually one).
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


class EngineProtocol(Protocol):
    """The engine operations ``EngineLoop`` calls, always from one thread."""

    limits: EngineLimits

    def add_request(self, request_id: str, prompt: list[int], params: dict[str, Any]) -> None:
        """Queue a request; ``params`` are ``SamplingParams`` keyword arguments."""

    def step(self) -> list[StepOutput]:
        """Run one scheduling step; outputs of every request that advanced."""

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests; they produce no further output."""

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
    """A vLLM v1 ``LLMEngine`` in this process, with this project's worker extension."""

    def __init__(self, model: str, engine_args: dict[str, Any]):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=model, worker_extension_cls=EXTENSION_CLASS, **engine_args)
        self._engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)
        # each running request's (top logprobs, top prompt logprobs)
        self._top_k: dict[str, tuple[int, int]] = {}
        config = self._engine.model_config
        self.limits = EngineLimits(
            vocab_size=config.get_vocab_size(),
            max_model_len=config.max_model_len,
            dtype=str(config.dtype).removeprefix("torch."),
            model=model,
        )

    def add_request(self, request_id: str, prompt: list[int], params: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = dict(params)
        adapter = params.pop("lora_request", None)  # LoRARequest fields: the adapter served
        kind = RequestOutputKind.FINAL_ONLY if params.get("prompt_logprobs") is not None else None
        sampling = SamplingParams(
            **params, output_kind=kind if kind is not None else RequestOutputKind.DELTA
        )
        self._engine.add_request(
            request_id,
            {"prompt_token_ids": prompt},
            sampling,
            lora_request=None if adapter is None else _lora_request(adapter),
        )
        self._top_k[request_id] = (
            int(params.get("logprobs") or 0),
            int(params.get("prompt_logprobs") or 0),
        )

    def step(self) -> list[StepOutput]:
        outputs = []
        for request in cast("list[RequestOutput]", self._engine.step()):
            completion = request.outputs[0]
            tokens = list(completion.token_ids)
            positions = list(completion.logprobs or [])
            logprobs = [_logprob_of(position, token) for position, token in zip(positions, tokens)]
            k, prompt_k = self._top_k.get(request.request_id, (0, 0))
            if request.finished:
                self._top_k.pop(request.request_id, None)
            prompt_logprobs = prompt_top = None
            if request.prompt_logprobs is not None:
                prompt = request.prompt_token_ids or []
                prompt_logprobs = [
                    _logprob_of(request.prompt_logprobs[t], prompt[t])
                    for t in range(1, len(prompt))
                ]
                if prompt_k:
                    prompt_top = [
                        _top_of(request.prompt_logprobs[t], prompt_k) for t in range(1, len(prompt))
                    ]
            outputs.append(
                StepOutput(
                    request_id=request.request_id,
                    token_ids=tokens,
                    logprobs=logprobs,
                    finish_reason=(completion.finish_reason or "unknown")
                    if request.finished
                    else None,
                    prompt_logprobs=prompt_logprobs,
                    topk_ids=[_top_of(p, k)[0] for p in positions] if k else None,
                    topk_logprobs=[_top_of(p, k)[1] for p in positions] if k else None,
                    prompt_topk_ids=[ids for ids, _ in prompt_top] if prompt_top else None,
                    prompt_topk_logprobs=[v for _, v in prompt_top] if prompt_top else None,
                    cached_tokens=int(request.num_cached_tokens or 0) if request.finished else None,
                    routed_experts=completion.routed_experts if request.finished else None,
                )
            )
        return outputs

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort_request(request_ids)
        for request_id in request_ids:
            self._top_k.pop(request_id, None)

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


def _top_of(position: Any, k: int) -> tuple[list[int], list[float]]:
    """The k likeliest tokens of one position and their logprobs, most likely first (vLLM
    adds the sampled token's own entry, with its rank, when it is not among them)."""
    ranked = sorted(
        (entry.rank, token, float(entry.logprob))
        for token, entry in position.items()
        if entry.rank is not None and 1 <= entry.rank <= k
    )
    return [token for _, token, _ in ranked], [logprob for _, _, logprob in ranked]


def _logprob_of(position: Any, token: int) -> float:
    """The logprob vLLM reports for ``token`` at one position (it always includes that token)."""
    if position is None or token not in position:
        from gen_interface import GenerationError

        raise GenerationError(f"vLLM returned no logprob for token {token}")
    return float(position[token].logprob)


def _lora_request(fields: dict[str, Any]) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(**fields)
