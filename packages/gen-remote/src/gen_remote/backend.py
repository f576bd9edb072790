"""``RemoteGeneration``: the generation interface, served by a server somewhere else.

The client does what needs no model: it checks every batch, resolves every row's sampling from
its own config (``resolve_sampling``), lays out the outputs and counts the metrics, exactly as
the local backends do through the same base. The server generates: each row is one streamed
request to ``/inference/v1/generate``, sent with its settings and its exact seed, so a row
comes back as it would in process. Weight updates, the life cycle and the staleness bound are
the server's (``weights.RemoteWeights``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from gen_backend_kit import GenerationBackend, GenerationCall, RowResult
from gen_backend_kit.lifecycle import RESOURCES, Resource
from gen_backend_kit.scoring import ScoreBatch, ScoredRow
from gen_backend_kit.stepping import RowControl
from gen_interface import BackendCapabilities, GenerationConfigError, RowEvent, StaleWeightsError
from gen_interface.config import GENERATION_CONFIG_DEFAULTS
from gen_interface.seeds import derive_sample_seeds

from gen_remote.config import RemoteConfig, complete_remote_config, remote_settings
from gen_remote.rows import GENERATE, RowAssembly, generate_body, score_body, scored_row_from_answer
from gen_remote.server import ServerInfo
from gen_remote.speculation import ServerSpeculation, check_speculation, with_server_speculation
from gen_remote.text import RemoteTextCodec
from gen_remote.weights import RemoteWeights
from gen_remote.wire import Wire

__all__ = ["RemoteGeneration"]

#: An item for the caller: ``(row, event or result)``, or ``(-1, error)`` when the call failed.
_Emit = Callable[[tuple[int, Any]], None]


class RemoteGeneration(RemoteWeights, GenerationBackend):
    """A backend whose model runs behind a gen-serve server (or vLLM's own server).

    ``{"backend": "remote", "remote_cfg": {"base_url": "http://host:8000"}}`` is a complete
    config: ``model_name``, ``pad_token_id``, ``stop_token_ids`` and ``speculative`` default to
    the server's, the sampling keys to the interface's defaults. While the server speculates,
    ``get_logger_metrics`` adds its ``speculative_*`` metrics since this client connected or
    last cleared them (``speculation``). ``shutdown`` closes this client only; the server and
    its backend keep running.

    Raises:
        BackendUnavailableError: the server cannot be reached.
        GenerationConfigError: the config is invalid, or asks what the server cannot do (another
            ``logprobs_mode`` or ``speculative`` than the server's backend, a staleness bound on
            vLLM's server).
    """

    config_schema = RemoteConfig
    settings_key = "remote_cfg"

    def __init__(self, config: Mapping[str, Any]):
        settings = remote_settings(config)
        self._wire = Wire(
            settings["base_url"],
            api_key=settings["api_key"],
            connect_timeout_s=settings["connect_timeout_s"],
            timeout_s=settings["timeout_s"],
            max_connections=settings["max_connections"],
        )
        try:
            self.server = ServerInfo.fetch(self._wire, settings["dialect"])
            complete = type(self).complete_config(_with_server_defaults(config, self.server))
            _check_against_server(complete, self.server)
        except BaseException:
            self._wire.close()
            raise
        self._announced = 0
        #: The server's speculative metrics, forwarded while it speculates (None: it does not).
        self._speculation = ServerSpeculation(self._wire) if complete.get("speculative") else None
        if self._speculation is not None:
            self._speculation.clear()  # count from the server's totals now
        super().__init__(
            complete,
            vocab_size=self.server.vocab_size,
            context_limit=self.server.context_limit,
            has_tokenizer=self.server.has_tokenizer,
            model_specs=None,
            max_top_logprobs=self.server.max_top_logprobs - 1,  # one deeper is asked: see rows
            routed_experts=self.server.routed_experts,
        )

    @classmethod
    def complete_config(cls, config: Mapping[str, Any]) -> RemoteConfig:
        return complete_remote_config(config)

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.server.backend_capabilities()

    @property
    def base_url(self) -> str:
        return self._wire.base_url

    # ---- generation ----------------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        results: list[RowResult | None] = [None] * call.size
        failure: list[BaseException] = []

        def keep(item: tuple[int, Any]) -> None:
            index, value = item
            if index < 0:
                failure.append(value)
            elif isinstance(value, RowResult):
                results[index] = control.finished(index, value)

        self._wire.run(self._all_rows(call, keep, tokens=False))
        if failure:
            raise failure[0]
        return results

    async def _stream_events(
        self, call: GenerationCall, *, tokens: bool = True
    ) -> AsyncIterator[tuple[int, RowEvent | RowResult]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        def emit(item: tuple[int, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone
                loop.call_soon_threadsafe(queue.put_nowait, item)

        work = self._wire.submit(self._all_rows(call, emit, tokens=tokens))
        left = call.size
        try:
            while left:
                index, item = await queue.get()
                if index < 0:
                    raise item
                left -= isinstance(item, RowResult)
                yield index, item
        finally:
            work.cancel()  # rows not finished end: their streams close, the server drops them

    async def _all_rows(self, call: GenerationCall, emit: _Emit, *, tokens: bool) -> None:
        """Every row of ``call`` as its own request (on the wire's loop); each event and result
        goes to ``emit`` as it comes, the first failure too (and the other rows end)."""
        staleness = self.config.get("max_weight_staleness")
        prompts = call.prompts.prompts()
        sessions = call.prompts.session_ids or [None] * call.size
        given = call.prompts.sample_seeds
        seeds = (
            given.tolist()
            if given is not None
            else derive_sample_seeds(self.config.get("seed"), call.size)
        )
        if staleness is not None and self.server.dialect != "gen-serve":
            emit((-1, GenerationConfigError(_NO_STALENESS)))
            return

        async def one(index: int) -> None:
            row = call.sampling.rows[index]
            body = generate_body(
                prompts[index],
                row,
                sample_seed=seeds[index],
                session=sessions[index],
                dialect=self.server.dialect,
                max_weight_staleness=staleness,
            )
            assembly = RowAssembly(row.top_logprobs)
            async for chunk in self._wire.stream(GENERATE, body):
                for choice in chunk.get("choices") or []:
                    event = assembly.add(index, choice)
                    if tokens and event.token_ids and not assembly.finished:
                        emit((index, event))
            emit((index, assembly.result(index)))

        rows = [asyncio.ensure_future(one(i)) for i in range(call.size)]
        try:
            for finished in asyncio.as_completed(rows):
                await finished
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if isinstance(exc, StaleWeightsError):  # the server refused the rows: count them
                self.metrics.stale(refused=True, rows=call.size)
            emit((-1, exc))
        finally:
            for row in rows:
                row.cancel()
            await asyncio.gather(*rows, return_exceptions=True)

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        async def one(index: int) -> ScoredRow:
            sequence = batch.sequences[index]
            answer = await self._wire.request("POST", GENERATE, score_body(sequence, top_logprobs))
            return scored_row_from_answer(
                answer, sequence, batch.prompt_lengths[index], top_logprobs
            )

        async def every() -> list[ScoredRow]:
            return list(await asyncio.gather(*(one(i) for i in range(len(batch.sequences)))))

        return self._wire.run(every())

    def _text_codec(self) -> RemoteTextCodec | None:
        return RemoteTextCodec(self._wire, self.server.dialect) if self.has_tokenizer else None

    def invalidate_kv_cache(self) -> bool:
        answer = self._wire.call("POST", "/reset_prefix_cache")
        return bool(answer.get("success", True)) if isinstance(answer, dict) else True

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        """The server's ``speculative_*`` metrics while it speculates (``speculation``)."""
        if self._speculation is None:
            return {}
        if clear:
            self._speculation.clear()
            return {}
        return self._speculation.metrics()

    def _newest_announced(self) -> int:
        return self._announced

    # ---- life cycle ----------------------------------------------------------------------

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        if self._drives_life_cycle:
            self._wire.call("POST", "/wake_up", params={"tags": list(resources)})

    def _release(self) -> frozenset[Resource]:
        if not self._drives_life_cycle:
            return frozenset()
        self._wire.call("POST", "/sleep")
        return frozenset(RESOURCES)  # the server's backend is finished, whatever it freed

    def _close(self) -> None:
        self._wire.close()

    @property
    def _drives_life_cycle(self) -> bool:
        return self.server.dialect == "gen-serve" and self.server.control_routes


def _with_server_defaults(config: Mapping[str, Any], server: ServerInfo) -> dict[str, Any]:
    """``config`` with what it leaves out taken from the server and the interface's defaults."""
    out = {**GENERATION_CONFIG_DEFAULTS, **config}
    theirs = server.config
    out.setdefault("model_name", server.model_name)
    if out.get("pad_token_id") is None:
        out["pad_token_id"] = theirs.get("pad_token_id", server.eos_token_id)
    if out.get("stop_token_ids") is None:
        out["stop_token_ids"] = theirs.get("stop_token_ids") or (
            [server.eos_token_id] if server.eos_token_id is not None else None
        )
    for key in _THE_SERVERS:  # what the server's backend computes with: its values
        if key not in config and key in theirs:
            out[key] = theirs[key]
    with_server_speculation(out, config, server)
    for key in ("pad_token_id", "stop_token_ids"):
        if out.get(key) is None:
            raise GenerationConfigError(
                f"{key} must be set: the server at {server.model_name!r} ({server.dialect}) "
                "does not say its model's"
            )
    return out


def _check_against_server(config: Mapping[str, Any], server: ServerInfo) -> None:
    """Refuse settings the server cannot honour, before any row is sent."""
    theirs = server.config
    for key in _THE_SERVERS:
        here, there = config.get(key), theirs.get(key, GENERATION_CONFIG_DEFAULTS[key])
        if server.dialect == "gen-serve" and here != there:
            raise GenerationConfigError(
                f"{key} is {here!r} here but {there!r} in the server's backend, which computes "
                f"with it: leave {key} out, or start the server with {key}: {here!r}"
            )
    check_speculation(config, server)
    if server.dialect == "vllm" and config.get("max_weight_staleness") is not None:
        raise GenerationConfigError(_NO_STALENESS)


#: Settings of the server's backend, not of a request: the client's must equal them.
_THE_SERVERS = ("logprobs_mode", "batch_invariant", "lm_head_fp32", "return_routed_experts")


_NO_STALENESS = (
    "max_weight_staleness needs a gen-serve server: vLLM's own server has no weight versions "
    "to bound"
)
