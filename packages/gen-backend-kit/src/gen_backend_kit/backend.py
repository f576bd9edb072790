"""``GenerationBackend``: what every backend shares, once, so each backend is only its own steps.

The base owns the public methods of ``GenerationInterface``: input validation, the per-row
sampling of a call (``resolve_sampling``), the staleness bound, the life cycle, the output
layout, ``with_sampling`` front ends, the weight-update transaction with its checks, the logger
metrics and ``generate_text``. A backend subclasses it and implements the steps that make it
different. The seams, declared once here:

**Implement** (the backend's steps; each default says what happens without it):

========================  =======================================================================
step                      what it does
========================  =======================================================================
``_run_rows``             generate every row of a validated ``GenerationCall`` (required)
``_stream_rows``          yield rows as they finish (default: ``_run_rows`` on a thread, rows
                          handed over as it reports them)
``_score_rows``           teacher-forced logprobs (default: ``score`` is not supported)
``_text_codec``           the tokenizer of ``generate_text`` (default: none, it is refused)
``_extra_metrics``        the backend's own logger metrics (default: none)
``_wake`` / ``_release``  the life cycle's resources (defaults: nothing sleeps)
``_close``                free everything (default: nothing)
``_load_handles``         write one load of shared weights (weight updates need it)
``_write_state_dict``     write one load from an in-process state dict (optional)
``_load_broadcast``       receive and write one broadcast bucket (optional)
``_begin_update`` ...     pause, commit and abort around the loads on the backend's workers
``_weight_base``          the base deltas apply to (default: none, every tensor comes whole)
``_restore_weights``      undo a dropped update's loads (default: cannot)
========================  =======================================================================

**May override**: ``capabilities`` (say what the steps offer), ``complete_config`` (the
backend's own settings), ``create`` (build what the constructor needs), ``set_weight_loading``
(through ``settings_key``), ``invalidate_kv_cache``, ``collective_ranks`` / ``init_collective``
(the collective transport), ``_newest_announced`` (where the newest announced weight version is
kept elsewhere: a server's), and a public method when it extends the base's (call ``super()``;
gen-remote replaces the weight-update methods, since its server runs the transaction).

**May use**: ``config``, ``lifecycle`` (the life cycle's state machine: ``generating``,
``breaks_on_fatal``, ``updating_weights`` ...), ``metrics`` (the counters behind
``get_logger_metrics``), ``weight_updates`` (the transaction state, None without updates),
``routing``, ``vocab_size``, ``context_limit``, ``max_top_logprobs``, ``has_tokenizer``.

**Leave alone**: every other attribute, and the public methods' bodies (validation, admission,
counting and the transaction's checks happen there, so a backend that bypasses them breaks the
contract).

A ``BackendBrokenError`` raised by any step marks the backend broken (every later call but
``shutdown`` refuses, saying why).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self, cast

import torch
from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.config import validate_generation_config, with_per_call_overrides
from gen_interface.errors import GenerationConfigError, GenerationInputError, WeightUpdateError
from gen_interface.events import RowEvent
from gen_interface.interface import GenerationInterface, InFlight
from gen_interface.specs import (
    GenerationConfig,
    GenerationDatumSpec,
    GenerationOutputSpec,
    ScoreOutputSpec,
    ScoreSpec,
)
from gen_interface.weights.handles import LoadSize, WeightBase, describe_slots

from gen_backend_kit.inputs import normalize_generation_input
from gen_backend_kit.lifecycle import Lifecycle, LifecycleView, Resource
from gen_backend_kit.metrics import CallCount, GenerationMetrics
from gen_backend_kit.outputs import (
    RowResult,
    build_generation_output,
    build_row_output,
    check_every_row,
    last_event,
)
from gen_backend_kit.row_sampling import GenerationCall, resolve_sampling
from gen_backend_kit.scoring import ScoreBatch, ScoredRow, checked_score_input, scatter_scores
from gen_backend_kit.speculation import refuse_unoffered_speculation
from gen_backend_kit.stepping import RowControl
from gen_backend_kit.text import TextCodec, generate_text
from gen_backend_kit.threaded_rows import CallThreads, rows_from_thread
from gen_backend_kit.weights.consumer import (
    TensorSpecs,
    check_update_is_complete,
    check_weights_match,
    delta_bases,
    release_shared_weights,
    state_dict_specs,
)
from gen_backend_kit.weights.updates import LoadWait, WeightUpdates, WeightUpdateSteps

__all__ = ["GenerationBackend", "GenerationCall"]

logger = logging.getLogger(__name__)

#: The longest a shutdown waits for calls still running on threads of their own to end.
_CALL_STOP_S = 30.0


class GenerationBackend(GenerationInterface):
    """The shared body of a backend; subclasses implement the steps listed in the module doc.

    A subclass completes its config (``complete_config``), builds its model or workers, then
    calls ``super().__init__``.

    Args:
        config: the completed config.
        vocab_size: token ids must lie below it; None: not checked.
        context_limit: the longest prompt + generation; prompts must be shorter. None: no limit.
        has_tokenizer: stop strings can be honoured; without one they are refused.
        model_specs: ``{checkpoint name: (shape, dtype)}`` every weight update must match, or
            None when the backend cannot update weights.
        optional_weights: names an update may omit (aliases of tied weights).
        weights_absent: why there are no real weights yet (started without reading the
            checkpoint), or None.
        max_top_logprobs: the most ``top_logprobs`` a row may ask for; None: no limit.
        routed_experts: ``(MoE layers, top_k)`` when the backend returns the model's routing
            (``return_routed_experts``); None: the model has no MoE router it can read.
        staged_weights: names of ``model_specs`` refitted on their own and staged until the
            commit (a LoRA adapter's tensors; see ``WeightUpdates``).
    """

    #: The level of the config holding the backend's own settings and its ``load_format``
    #: (``"auto"``: read the checkpoint; ``"dummy"``: the first weight update brings them).
    settings_key: ClassVar[str | None] = None
    #: The ``speculative.method`` values this backend honours (its capabilities report them);
    #: ``complete_config`` refuses any other by name.
    speculative_methods: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        config: GenerationConfig,
        *,
        vocab_size: int | None,
        context_limit: int | None,
        has_tokenizer: bool,
        model_specs: TensorSpecs | None,
        optional_weights: Collection[str] = (),
        weights_absent: str | None = None,
        max_top_logprobs: int | None = None,
        routed_experts: tuple[int, int] | None = None,
        staged_weights: Collection[str] = (),
    ):
        if config.get("return_routed_experts") and routed_experts is None:
            raise GenerationConfigError(
                f"return_routed_experts is true but {type(self).__name__} finds no MoE router "
                f"to read in model {config.get('model_name')!r}; set it to false"
            )
        self.config = config
        self.routing = routed_experts if config.get("return_routed_experts") else None
        self.max_top_logprobs = max_top_logprobs
        self.vocab_size = vocab_size
        self.context_limit = context_limit
        self.has_tokenizer = has_tokenizer
        self._lifecycle: Lifecycle | LifecycleView = Lifecycle(
            type(self).__name__,
            wake=self._wake,
            release=self._release,
            close=self._close,
            weights_absent=weights_absent,
        )
        self._metrics = GenerationMetrics()
        self._call_threads = CallThreads()  # shared with ``with_sampling`` front ends
        self._owns_calls = True  # False on a front end: its shutdown ends no call
        self._weights: WeightUpdates | None = None
        if model_specs is not None:
            self._weights = WeightUpdates(
                self._lifecycle,
                model_specs,
                optional_weights,
                WeightUpdateSteps(
                    load=self._load_handles,
                    begin=self._begin_update,
                    commit=self._commit_update,
                    abort=self._abort_update,
                    restore=self._restore_weights,
                ),
                self._metrics,
                staged_weights,
            )

    # ---- what a backend may use -----------------------------------------------------------

    @property
    def lifecycle(self) -> Lifecycle | LifecycleView:
        """The life cycle's state machine (``gen_backend_kit.lifecycle``): a backend wraps its
        own long calls in ``lifecycle.generating()``, ``lifecycle.breaks_on_fatal()`` or
        ``lifecycle.updating_weights()`` and checks ``lifecycle.check_open(...)``."""
        return self._lifecycle

    @property
    def metrics(self) -> GenerationMetrics:
        """The counters behind ``get_logger_metrics``; a backend that runs a call or a refit
        outside the base's methods records it here."""
        return self._metrics

    @property
    def weight_updates(self) -> WeightUpdates | None:
        """The weight-update transaction state (None: the backend takes no updates)."""
        return self._weights

    # ---- configuration -------------------------------------------------------------------

    @classmethod
    def complete_config(cls, config: Mapping[str, Any]) -> GenerationConfig:
        """A validated copy of ``config`` with the backend's own defaults filled in.

        The default checks it against ``config_schema``. Backends with settings of their own
        override it; ``with_sampling`` runs it on every front end's config too.

        Raises:
            GenerationConfigError: naming the field at fault.
        """
        validate_generation_config(
            config, schema=cls.config_schema, foreign=cls.config_foreign_keys
        )
        for setting in ("batch_invariant", "lm_head_fp32", "return_routed_experts", "lora"):
            if config.get(setting):
                raise GenerationConfigError(
                    f"{setting} is set but {cls.__name__} does not offer it; use backend 'hf' "
                    f"(or 'vllm'), or leave {setting} out"
                )
        refuse_unoffered_speculation(config, cls.__name__, cls.speculative_methods)
        return cast(GenerationConfig, copy.deepcopy(dict(config)))

    @classmethod
    def set_weight_loading(cls, config: dict[str, Any], *, read_checkpoint: bool) -> None:
        """Sets ``config[settings_key]["load_format"]``: ``"auto"`` or ``"dummy"``."""
        if cls.settings_key is None:
            super().set_weight_loading(config, read_checkpoint=read_checkpoint)
            return
        settings = config.get(cls.settings_key)
        config[cls.settings_key] = {
            **(settings if isinstance(settings, Mapping) else {}),
            "load_format": "auto" if read_checkpoint else "dummy",
        }

    def with_sampling(self, **overrides: Any) -> Self:
        view = copy.copy(self)
        view.config = type(self).complete_config(with_per_call_overrides(self.config, overrides))
        if view.config.get("stop_strings") and not self.has_tokenizer:
            raise GenerationConfigError(self._no_tokenizer("stop_strings"))
        view._lifecycle = self._lifecycle.view()
        view._owns_calls = False
        return view

    # ---- generation ----------------------------------------------------------------------

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        call = self._new_call(data, greedy)
        if self._weights is not None:
            self._weights.admit(self.config.get("max_weight_staleness"), call.size)
        with self._running(call) as count:
            rows = self._run_rows(call, RowControl())
            check_every_row({i for i, row in enumerate(rows) if row is not None}, call.size)
            for row in rows:
                count.row(cast(RowResult, row))
        return build_generation_output(
            call.prompts,
            cast(list[RowResult], list(rows)),
            self.config["pad_token_id"],
            call.sampling.max_top_logprobs,
            self.routing,
        )

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncGenerator[tuple[int, BatchedDataDict[GenerationOutputSpec]], None]:
        """Yield ``(row index, one-row output)`` as rows finish: the rows ``generate`` returns.
        Closing the iterator early ends the rows not yet returned."""
        call = self._new_call(data, greedy)
        if self._weights is not None:
            await self._weights.admit_async(self.config.get("max_weight_staleness"), call.size)
        pad, top_k = self.config["pad_token_id"], call.sampling.max_top_logprobs
        seen: set[int] = set()
        with self._running(call) as count:
            async for index, row in self._stream_rows(call):
                seen.add(index)
                count.row(row)
                yield index, build_row_output(call.prompts, index, row, pad, top_k, self.routing)
        check_every_row(seen, call.size)

    async def generate_stream(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncGenerator[RowEvent, None]:
        """Yield ``RowEvent``s as tokens are chosen: the rows ``generate`` returns, token by
        token where the backend can (else each row in one event). Closing the iterator early
        ends the rows not yet finished."""
        call = self._new_call(data, greedy)
        if self._weights is not None:
            await self._weights.admit_async(self.config.get("max_weight_staleness"), call.size)
        pad, top_k = self.config["pad_token_id"], call.sampling.max_top_logprobs
        sent = [0] * call.size  # tokens already streamed, per row
        done: set[int] = set()
        with self._running(call) as count:
            async for index, step in self._stream_events(call):
                if isinstance(step, RowResult):  # the row ended: what was not streamed, and it
                    done.add(index)
                    count.row(step, index)
                    output = build_row_output(call.prompts, index, step, pad, top_k, self.routing)
                    yield last_event(index, step, sent[index], output)
                else:
                    sent[index] += len(step.token_ids)
                    count.token(index)
                    yield step
        check_every_row(done, call.size)

    def score(self, data: BatchedDataDict[ScoreSpec]) -> torch.Tensor:
        if not self._implements("_score_rows"):
            return super().score(data)
        return self.score_top_logprobs(data, 0)["logprobs"]

    def score_top_logprobs(
        self, data: BatchedDataDict[ScoreSpec], top_logprobs: int
    ) -> BatchedDataDict[ScoreOutputSpec]:
        if not self._implements("_score_rows"):
            return super().score_top_logprobs(data, top_logprobs)
        batch = checked_score_input(
            data,
            top_logprobs,
            max_top_logprobs=self.max_top_logprobs,
            vocab_size=self.vocab_size,
            context_limit=self.context_limit,
        )
        with self._lifecycle.generating(), self._lifecycle.breaks_on_fatal():
            rows = self._score_rows(batch, top_logprobs) if batch.sequences else []
        return scatter_scores(batch, rows, top_logprobs, self.routing)

    def _new_call(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool) -> GenerationCall:
        """Validate the batch and resolve every row's sampling, before anything runs."""
        prompts = normalize_generation_input(
            data,
            pad_token_id=self.config["pad_token_id"],
            vocab_size=self.vocab_size,
            context_limit=self.context_limit,
        )
        sampling = resolve_sampling(self.config, prompts, greedy=greedy)
        limit = self.max_top_logprobs
        if limit is not None and sampling.max_top_logprobs > limit:
            row = next(i for i, r in enumerate(sampling.rows) if r.top_logprobs > limit)
            raise GenerationInputError(
                f"top_logprobs row {row} is {sampling.rows[row].top_logprobs}; this "
                f"{type(self).__name__} returns at most {limit} (its setting max_logprobs)"
            )
        if sampling.needs_tokenizer and not self.has_tokenizer:
            row = next(i for i, r in enumerate(sampling.rows) if r.stop_strings)
            raise GenerationInputError(
                f"stop_strings row {row} is {list(sampling.rows[row].stop_strings)!r}, but "
                + self._no_tokenizer("stop strings")
            )
        return GenerationCall(prompts, sampling)

    # ---- life cycle ----------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._lifecycle.state

    def prepare_for_generation(
        self, *args: Any, tags: list[str] | None = None, **kwargs: Any
    ) -> None:
        """Wake what ``finish_generation`` put to sleep: weights first, then the KV cache.

        ``tags`` (NeMo RL's): wake only ``"weights"`` and/or ``"kv_cache"``. Idempotent.
        """
        with self._lifecycle.breaks_on_fatal():
            self._lifecycle.prepare(tags)

    def finish_generation(self, *args: Any, **kwargs: Any) -> None:
        with self._lifecycle.breaks_on_fatal():
            self._lifecycle.finish()

    def shutdown(self) -> None:
        """Free everything the backend holds (a ``with_sampling`` front end closes only itself).
        Calls still running on threads of their own are cancelled and waited for first (up to
        ``_CALL_STOP_S``). Idempotent."""
        left = self._call_threads.stop(_CALL_STOP_S) if self._owns_calls else []
        if left:
            logger.warning("shutting down while %d call(s) still run: %s", len(left), left)
        self._lifecycle.shutdown()

    @contextlib.contextmanager
    def _running(self, call: GenerationCall) -> Iterator[CallCount]:
        """A call's rows run: counted, in the life cycle's generating state, fatal errors
        breaking the backend."""
        life = self._lifecycle
        with (
            self._metrics.call(call.size, self._newest_announced) as count,
            life.generating(),
            life.breaks_on_fatal(),
        ):
            yield count

    def _newest_announced(self) -> int:
        """The newest weight version announced: what metrics count versions behind from.
        A backend whose versions are announced elsewhere (a server's) overrides it."""
        return self._weights.announced if self._weights is not None else 0

    # ---- weight updates --------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weights.version if self._weights is not None else 0

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        weights = self._weight_updates("start_weight_update")
        with self._lifecycle.breaks_on_fatal():
            return weights.start(version, in_flight)

    def announce_weight_version(self, version: int) -> None:
        self._weight_updates("announce_weight_version").announce(version)

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        weights = self._weight_updates("update_weights_from_ipc_handles")
        try:
            with self._lifecycle.breaks_on_fatal():
                weights.load(handles)
        finally:
            release_shared_weights(handles)

    def update_weights_from_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        weights = self._weight_updates("update_weights_from_state_dict", "_write_state_dict")
        with self._lifecycle.breaks_on_fatal():
            weights.load_described(
                state_dict_specs(state_dict), lambda: self._write_state_dict(state_dict)
            )

    def update_weights_from_collective(self, bucket: Mapping[str, Any]) -> None:
        weights = self._weight_updates("update_weights_from_collective", "_load_broadcast")
        with self._lifecycle.breaks_on_fatal():
            weights.load_described(
                describe_slots(bucket["tensors"]),
                lambda: self._load_broadcast(bucket),
                size=LoadSize.of_slots(bucket["tensors"]),
                bases=delta_bases(bucket["tensors"]),
            )

    def weight_base(self) -> WeightBase | None:
        if self._weights is None or self._lifecycle.state in ("shut down", "broken"):
            return None
        with self._lifecycle.breaks_on_fatal():
            return self._weight_base()

    def commit_weight_update(self, version: int | None = None) -> int:
        weights = self._weight_updates("commit_weight_update")
        with self._lifecycle.breaks_on_fatal():
            return weights.commit(version)

    def abort_weight_update(self) -> None:
        weights = self._weight_updates("abort_weight_update")
        with self._lifecycle.breaks_on_fatal():
            weights.abort()

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        """Check that updates described by ``state_dict_info`` fit the model: every name known,
        shapes equal, dtypes castable, and every weight of the model present."""
        weights = self._weight_updates("prepare_refit_info")
        check_weights_match(state_dict_info, weights.model)
        check_update_is_complete(state_dict_info, weights.model, weights.optional)

    def _weight_updates(self, method: str, step: str = "_load_handles") -> WeightUpdates:
        """The transaction state, once the backend is known to take updates this way."""
        if self._weights is None or not self._implements(step):
            raise NotImplementedError(f"{type(self).__name__} does not support {method}")
        self._lifecycle.check_open(WeightUpdateError)
        return self._weights

    # ---- logger metrics and text ------------------------------------------------------------

    def generate_text(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        return generate_text(self, self._text_codec(), data, greedy)

    def get_logger_metrics(self) -> dict[str, int | float]:
        return self._metrics.snapshot(self._extra_metrics())

    def clear_logger_metrics(self) -> None:
        self._metrics.clear()
        self._extra_metrics(clear=True)

    # ---- the backend's steps -------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        """Generate every row of ``call``: one result per row, in input order.

        Report each row through ``control.finished`` as it ends (``_stream_rows`` hands them
        over then) and stop early once ``control.cancelled`` is set. A row the backend lost is
        None: the call then raises ``GenerationError`` naming it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _run_rows")

    async def _stream_rows(self, call: GenerationCall) -> AsyncIterator[tuple[int, RowResult]]:
        """Yield ``(row index, result)`` as rows finish; closing the iterator ends the call.

        The default keeps the finished rows of ``_stream_events``.
        """
        async for index, step in self._stream_events(call, tokens=False):
            if isinstance(step, RowResult):
                yield index, step

    async def _stream_events(
        self, call: GenerationCall, *, tokens: bool = True
    ) -> AsyncIterator[tuple[int, RowEvent | RowResult]]:
        """Yield ``(row index, RowEvent)`` for new tokens (when ``tokens``) and
        ``(row index, RowResult)`` as each row finishes; closing the iterator ends the call.

        The default runs ``_run_rows`` on a thread and hands over what it reports through its
        ``RowControl`` as it happens (rows it returns without reporting come after it returns);
        a backend with a ``_stream_rows`` of its own streams whole rows through it instead.
        """
        if self._implements("_stream_rows"):
            async for whole_row in self._stream_rows(call):
                yield whole_row
            return
        run_rows = functools.partial(self._run_rows, call)
        rows = rows_from_thread(
            run_rows, tokens=tokens, name=type(self).__name__, threads=self._call_threads
        )
        async for item in rows:
            yield item

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        """Per row, the raw logprob of each response token and the ``top_logprobs`` likeliest
        tokens at each response position (``scoring.scored_row`` builds one from logits)."""
        raise NotImplementedError(f"{type(self).__name__} does not support score")

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        """Bring back the given resources (asleep now), in the order given."""

    def _release(self) -> frozenset[Resource]:
        """Free what generation holds; return what is now asleep."""
        return frozenset()

    def _close(self) -> None:
        """Free everything, once (``lifecycle.close_all`` runs every step even if one fails)."""

    def _text_codec(self) -> TextCodec | None:
        """The tokenizer ``generate_text`` goes through (None: it is refused)."""
        return None

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        """The backend's own metrics since the last clear (``clear``: start them anew)."""
        return {}

    def _load_handles(self, handles: Mapping[str, Any]) -> LoadWait | None:
        """Write one load of shared weights (already checked against the model) everywhere,
        or queue it on workers that run loads in order and return its wait (see
        ``WeightUpdateSteps.load``)."""
        raise NotImplementedError(f"{type(self).__name__} does not support weight updates")

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write one load from an in-process state dict (already checked)."""
        raise NotImplementedError

    def _load_broadcast(self, bucket: Mapping[str, Any]) -> None:
        """Receive one broadcast bucket on every worker and write it (already checked)."""
        raise NotImplementedError

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        """Prepare for loads: running rows pause (``"keep"``) or end cut short (``"abort"``)."""

    def _weight_base(self) -> WeightBase | None:
        """The base deltas apply to: a ``CommittedWeights``' ``base()`` (the kit's readable copy
        of the last committed weights), or None to take every tensor whole (the default)."""
        return None

    def _restore_weights(self) -> bool:
        """An update is dropped after loads were written: put the old weights back if possible
        (a ``CommittedWeights`` viewing the model undoes its deltas) and return whether that
        was done; then ``_abort_update`` gets ``written=False`` and rows paused go on."""
        return False

    def _commit_update(self, version: int) -> None:
        """Every weight arrived: verify, label the weights ``version``, let paused rows go on."""

    def _abort_update(self, written: bool) -> None:
        """The update is dropped. ``written``: some loads were written, so rows paused by
        ``_begin_update`` must not go on (their next tokens would come from part-old, part-new
        weights): end them cut short. Otherwise they resume as if nothing happened."""

    # ---- helpers -------------------------------------------------------------------------

    def _implements(self, step: str) -> bool:
        return getattr(type(self), step) is not getattr(GenerationBackend, step)

    def _no_tokenizer(self, what: str) -> str:
        return (
            f"{what} need a tokenizer and this {type(self).__name__} has none (model "
            f"{self.config.get('model_name')!r}); use stop_token_ids"
        )
