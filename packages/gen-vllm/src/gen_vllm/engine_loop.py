"""``EngineLoop``: one engine stepped on its own thread, driven from an asyncio event loop.

The engine is not thread-safe, so one thread owns it: it runs queued commands (add, abort, weight
loads, sleep, ...) between steps and steps while requests are pending. Rows reach it in batches
(``add_rows``: one command for any number of rows) and leave through ``feed``: after each step,
one ``StepBatch`` with the new tokens of the rows that stream and every row that ended, so the
driver hears of a whole step in one message. Rows run for the worker itself (``generate``: its
scoring) resolve a future of their own instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast, get_args

import numpy as np
from gen_backend_kit import FinishReason
from gen_interface import BackendBrokenError, GenerationError

from gen_vllm.engine import EngineProtocol, StepOutput
from gen_vllm.messages import RowFailure, RowOutput, RowRequest, StepBatch
from gen_vllm.routing import to_wire
from gen_vllm.step_feed import HAND_OVER_S, StepFeed

__all__ = ["EngineFailedError", "EngineLoop"]


class EngineFailedError(BackendBrokenError):
    """An engine step failed: the engine's state is unknown, so it takes no more rows."""


logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Rows from which a forward pass with no streaming row takes every core of the engine's share
#: (``wide_threads``): a smaller batch's forward is too short to split across threads with gain
#: (at batch 1 one thread is faster than vLLM's own two).
WIDE_ROWS = 16


@dataclass
class _Pending:
    """A request in the engine and what it has produced so far.

    ``future``: where its result goes (a row the worker runs for itself); None: to ``feed``.
    """

    future: asyncio.Future[RowOutput] | None
    request_id: str
    stream: bool = False
    output: RowOutput = field(default_factory=RowOutput)
    version: int = 0  # the weights in force when it was added


class EngineLoop:
    """Builds an engine on a daemon thread and owns it there until ``close()``.

    The engine is built on the thread that steps it: vLLM's CPU kernels record the thread count
    of the thread that set them up and refuse to run on one with another count.

    Args:
        build: makes the engine (may take a while); the constructor waits for it.
        name: the thread's name, for logs.
        num_threads: torch (OpenMP) threads for the engine thread; None keeps torch's default.
        wide_threads: threads for a step while at least ``WIDE_ROWS`` rows run and none
            streams (every core of the engine's share); None, or no ``num_threads``: every
            step keeps the thread's count.

    Raises:
        Whatever ``build`` raises.
    """

    def __init__(
        self,
        build: Callable[[], EngineProtocol],
        name: str = "vllm-engine",
        num_threads: int | None = None,
        wide_threads: int | None = None,
    ):
        self._threads = num_threads
        # the rule needs both counts: without ``num_threads`` a step could not go back
        wide = wide_threads if num_threads and wide_threads != num_threads else None
        self._wide_threads = wide
        self._threads_now = num_threads
        self._commands: list[Callable[[], None]] = []
        self._pending: dict[str, _Pending] = {}
        self._wake = threading.Condition()
        self._paused = False
        self._stopped = False
        self._failure: str | None = None
        self._version = 0
        #: rows carry their routing, read in the worker ("capture": requests then read no
        #: prefix cache) or by vLLM's own option ("native"); None: not asked
        self._routing: str | None = None
        self._experts = 0  # experts per MoE layer (the routing's wire dtype)
        #: ``LoRARequest`` fields of the adapter every request is served with, or None.
        self.adapter: dict[str, Any] | None = None
        #: What each step produced for the rows added with ``add_rows``.
        self.feed = StepFeed()
        self._step_out = StepBatch()  # what the step (or command) running now produced
        built: concurrent.futures.Future[EngineProtocol] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(build, num_threads, built), name=name, daemon=True
        )
        self._thread.start()
        self.engine = built.result()

    # ---- asyncio side --------------------------------------------------------------------

    async def add_rows(self, requests: list[RowRequest]) -> None:
        """Add rows to the engine in one command, between two steps; their results (and the
        new tokens of those that stream) come through ``feed``.

        Raises:
            EngineFailedError: the engine failed earlier; no row was added.
        """

        def add() -> None:
            self._check_usable()
            for request in requests:
                self._add(request, None)

        await self.call(add)

    def abort_rows(self, request_ids: list[str]) -> None:
        """Drop rows (the caller gave up on them): they report nothing more."""
        self.post(lambda: self._abort(request_ids, report=False))

    async def generate(self, request: RowRequest) -> RowOutput:
        """Run one row for this worker to its end (or until it is cut short); cancelling
        aborts it."""
        future: asyncio.Future[RowOutput] = asyncio.get_running_loop().create_future()

        def add() -> None:
            self._check_usable()
            self._add(request, future)

        try:
            await self.call(add)
            return await future
        except asyncio.CancelledError:
            self.post(lambda: self._abort([request.request_id], report=False))
            raise

    def _add(self, request: RowRequest, future: asyncio.Future[RowOutput] | None) -> None:
        params = request.params
        if self._routing == "capture":  # a position read from the cache has no routing
            params = {**params, "skip_reading_prefix_cache": True}
        if self.adapter is not None:
            params = {**params, "lora_request": self.adapter}
        self.engine.add_request(request.request_id, request.prompt, params, request.stream)
        self._pending[request.request_id] = _Pending(
            future, request.request_id, request.stream, version=self._version
        )

    async def call(self, command: Callable[[], T]) -> T:
        """Run ``command`` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(command))

    def run(self, command: Callable[[], T]) -> T:
        """``call`` for code that is not on an event loop (the worker's constructor)."""
        return self.submit(command).result()

    def submit(self, command: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``command`` for the engine thread; its future holds the result or error."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def wrapped() -> None:
            # A caller that gave up (a cancelled row) cancels ``done``: skip the command if it
            # has not started; once it runs, ``done`` can no longer be cancelled, so setting its
            # outcome cannot fail (which would end this thread and strand every row).
            if not done.set_running_or_notify_cancel():
                return
            try:
                result = command()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(result)

        self.post(wrapped)
        return done

    def post(self, command: Callable[[], None]) -> None:
        with self._wake:
            if self._stopped:
                raise GenerationError("this vLLM engine is shut down")
            self._commands.append(command)
            self._wake.notify()

    # ---- engine-thread commands (call these inside ``call``/``run``) ----------------------

    def pause(self) -> None:
        """Stop stepping; running requests keep their place and resume after ``resume``."""
        if not self._paused:
            self.engine.pause()
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self.engine.resume()
            self._paused = False

    def cut_all(self) -> int:
        """End every running request now: each returns its tokens so far as ``"abort"``."""
        ids = list(self._pending)
        self._abort(ids, report=True)
        self._flush()
        return len(ids)

    def capture_routing(self, native: bool = False) -> list[int] | str:
        """Return every request's MoE routing from now on, read in the worker, or (``native``)
        as vLLM's own option returns it: ``[layers, top_k, experts]``, or why the engine cannot
        (see ``UpdatableVllmInternalWorker.capture_routed_experts``)."""
        shape: list[int] | str = self.engine.collective_rpc("capture_routed_experts", (native,))[0]
        if not isinstance(shape, str):
            self._routing, self._experts = ("native" if native else "capture"), int(shape[2])
        return shape

    def set_version(self, version: int) -> None:
        """Tokens produced from now on come from weights ``version``."""
        self.engine.set_weight_version(version)
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (pending requests fail) and shut the engine down. Idempotent."""
        with self._wake:
            if self._stopped:
                return
            self._commands.append(self._fail_all_and_shutdown)
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _fail_all_and_shutdown(self) -> None:
        try:
            self._fail_all("the engine was shut down")
            self.engine.shutdown()
        finally:
            self.feed.close()

    # ---- the thread --------------------------------------------------------------------------

    def _run(
        self,
        build: Callable[[], EngineProtocol],
        num_threads: int | None,
        built: concurrent.futures.Future[EngineProtocol],
    ) -> None:
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        try:
            built.set_result(build())
        except BaseException as exc:
            built.set_exception(exc)
            return
        while True:
            with self._wake:
                while not self._commands and not self._stopped and not self._should_step():
                    self._wake.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopped and not commands
            for command in commands:
                try:
                    command()
                except Exception:  # a command's own bug must not stop the engine for every row
                    logger.exception("a command on the vLLM engine thread failed")
            if stopping:
                return
            if self._should_step():
                self._step()

    def _should_step(self) -> bool:
        return bool(self._pending) and not self._paused and self._failure is None

    def _step(self) -> None:
        if self._wide_threads is not None:
            self._fit_threads()
        started = time.perf_counter()
        try:
            deltas, ended, finished_at = self.engine.step()
        except Exception as exc:
            logger.exception("vLLM engine step failed")
            self._failure = (
                f"an engine step failed: {type(exc).__name__}: {exc}; the engine's state is "
                "unknown, so its backend is broken: shut it down and build a new one"
            )
            self._fail_all(self._failure, EngineFailedError)
            return
        pending = self._pending  # a row aborted without a report reports nothing more
        self._step_out.deltas.extend([d for d in deltas if d.request_id in pending])
        for step in ended:
            self._record(step)
        self._flush(time.perf_counter() - started, finished_at)

    def _fit_threads(self) -> None:
        """Set the step's forward-pass threads: ``wide_threads`` while at least ``WIDE_ROWS``
        rows run and none streams, since the token path (this worker's messages, the driver)
        then has nothing to do until a row ends; otherwise ``num_threads``, which leaves a core
        to the token path that every step feeds. The count changes between steps only, so a
        step's attention metadata and kernels see one count."""
        import torch

        wide = len(self._pending) >= WIDE_ROWS and not any(p.stream for p in self._pending.values())
        threads = self._wide_threads if wide else self._threads
        if threads is not None and threads != self._threads_now:
            # vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once it starts
            torch._C.set_num_threads(threads)
            self._threads_now = threads

    def _flush(self, step_seconds: float | None = None, finished_at: float | None = None) -> None:
        """Hand what the step (or command) produced to ``feed``, in one push; ``finished_at``:
        when the engine finished the step (None: now)."""
        out, self._step_out = self._step_out, StepBatch()
        self.feed.push(out.deltas, out.finished, out.failed, step_seconds, HAND_OVER_S, finished_at)

    def _record(self, step: StepOutput) -> None:
        pending = self._pending.get(step.request_id)
        if pending is None:
            return
        out = pending.output  # the row's every token, reported once, as it ends
        out.token_ids = step.token_ids
        out.logprobs = step.logprobs
        out.weight_versions = step.weight_versions or [self._version] * len(step.token_ids)
        out.topk_ids, out.topk_logprobs = step.topk_ids, step.topk_logprobs
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs
            out.prompt_topk_ids = step.prompt_topk_ids
            out.prompt_topk_logprobs = step.prompt_topk_logprobs
        if step.cached_tokens is not None:
            out.cached_tokens = step.cached_tokens
        if step.speculation is not None:
            out.speculation = step.speculation
        if step.routed_experts is not None and self._routing == "native":
            out.routed_experts = to_wire(np.asarray(step.routed_experts), self._experts)
        if step.finish_reason is not None:
            del self._pending[step.request_id]
            if step.finish_reason not in get_args(FinishReason):
                self._fail(
                    pending,
                    GenerationError(
                        f"vLLM ended request {step.request_id} for {step.finish_reason!r} after "
                        f"{len(out.token_ids)} tokens: the row failed inside the engine"
                    ),
                )
                return
            out.finish_reason = cast(FinishReason, step.finish_reason)
            self._finish(pending)

    def _abort(self, request_ids: list[str], *, report: bool) -> None:
        live = [i for i in request_ids if i in self._pending]
        if not live:
            return
        finals = {final.request_id: final for final in self.engine.abort(live)}
        for request_id in live:
            pending = self._pending[request_id]
            if report:
                final = finals.get(request_id)
                if final is not None:
                    self._record(dataclasses.replace(final, finish_reason=None))
                del self._pending[request_id]
                pending.output.finish_reason = "abort"
                self._finish(pending)
            else:
                del self._pending[request_id]
        if not report:
            self._take_routing(live)

    def _finish(self, pending: _Pending) -> None:
        out = pending.output
        out.weight_version = out.weight_versions[0] if out.weight_versions else pending.version
        if self._routing == "capture":
            out.routed_experts = self._take_routing([pending.request_id]).get(pending.request_id)
        if pending.future is not None:
            _resolve_future(pending.future, out)
        else:
            # as lists: the worker's loop puts every row's fields in columns (gen_vllm.wire)
            self._step_out.finished.append((pending.request_id, out))

    def _fail(self, pending: _Pending, error: GenerationError) -> None:
        if pending.future is not None:
            _fail_future(pending.future, error)
        else:
            self._step_out.failed.append(
                RowFailure(pending.request_id, str(error), isinstance(error, EngineFailedError))
            )

    def _take_routing(self, request_ids: list[str]) -> dict[str, bytes]:
        """The routing of ended requests (forgotten by the worker); nothing when not read."""
        if self._routing != "capture" or not request_ids:
            return {}
        per_rank = self.engine.collective_rpc("take_routed_experts", (request_ids,))
        return cast(dict[str, bytes], per_rank[0])  # every rank read the same routing

    def _fail_all(self, reason: str, error: type[GenerationError] = GenerationError) -> None:
        pending, self._pending = self._pending, {}
        with contextlib.suppress(Exception):  # an engine that failed may not answer
            self._take_routing(list(pending))
        for item in pending.values():
            self._fail(item, error(f"vLLM engine: {reason}"))
        self._flush()

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise EngineFailedError(f"this vLLM engine is unusable: {self._failure}")


def _resolve_future(future: asyncio.Future[RowOutput], value: RowOutput) -> None:
    loop = future.get_loop()

    def set_result() -> None:
        if not future.done():
            future.set_result(value)

    loop.call_soon_threadsafe(set_result)


def _fail_future(future: asyncio.Future[Any], error: BaseException) -> None:
    loop = future.get_loop()

    def set_exception() -> None:
        if not future.done():
            future.set_exception(error)

    loop.call_soon_threadsafe(set_exception)
