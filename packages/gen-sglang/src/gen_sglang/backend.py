"""``SglangGeneration``: the generation interface on SGLang servers, driven over SGLang's HTTP
API the way slime and AReaL drive it.

This process never imports sglang. It starts ``sglang_cfg.num_replicas`` servers from SGLang's
own environment (``environment``), checks every batch and resolves every row's sampling through
the shared base, and sends each row to a server as one streamed ``/generate`` request with its
own settings and seed (``rows``). Weight updates pause the servers (``/pause_generation``:
``retract`` keeps the rows, ``abort`` ends them), stage the new weights in a checkpoint file in
shared memory (``checkpoint.StagedCheckpoint``), and at the commit load that file into every
server (``/update_weights_from_disk``, labelled with the new version) before
``/continue_generation``. SGLang reports which weight version produced each token.

The servers are a fleet (``fleet.ServerFleet`` over the kit's ``FleetHealth``): with
``sglang_cfg.healing`` a server that dies is replaced in the background, and the rows it held
that had handed nothing to the caller run again on a serving server (``_on_servers``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import torch
from gen_backend_kit import GenerationBackend, GenerationCall, RowResult
from gen_backend_kit.fleet_health import FleetHealth
from gen_backend_kit.lifecycle import RESOURCES, Resource
from gen_backend_kit.scoring import ScoreBatch, ScoredRow
from gen_backend_kit.settings import resolve_dtype
from gen_backend_kit.speculation import refuse_unoffered_speculation
from gen_backend_kit.stepping import RowControl
from gen_backend_kit.weights.consumer import write_shared_weights
from gen_interface import (
    BackendBrokenError,
    BackendCapabilities,
    BackendUnavailableError,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    InFlight,
    MixedWeightsError,
    RowLostError,
    WeightUpdateError,
)
from gen_interface.config import GENERATION_CONFIG_DEFAULTS

from gen_sglang.checkpoint import ModelFacts, StagedCheckpoint, read_model_facts, serving_dir
from gen_sglang.config import SglangConfig, complete_sglang_config
from gen_sglang.environment import managed_python, support_dir
from gen_sglang.fleet import ServerFleet, ServerLostError
from gen_sglang.kv_cache import kv_bytes_per_token
from gen_sglang.rows import RowStream, batch_body, generate_body, score_body, scored_row
from gen_sglang.server import SglangServer
from gen_sglang.server_args import server_args
from gen_sglang.text import SglangTextCodec

__all__ = ["SglangGeneration"]

#: Requests in flight at once per backend (each a call's rows on one server).
_MAX_REQUESTS_IN_FLIGHT = 64


class SglangGeneration(GenerationBackend):
    """A backend whose model runs in SGLang servers this backend starts and stops.

    ``model_name`` must be a local model directory with safetensors weights (SGLang loads it;
    this backend reads its config and weight names). ``shutdown`` stops every server.

    Raises:
        GenerationConfigError: the config is invalid.
        BackendUnavailableError: SGLang's environment cannot be made, or a server does not start
            (the message quotes its log).
    """

    config_schema = SglangConfig
    settings_key = "sglang_cfg"

    def __init__(self, config: Mapping[str, Any]):
        model_dir = Path(str(config.get("model_name")))
        dtype = resolve_dtype(str(model_dir), config.get("dtype", "auto"))
        self._facts: ModelFacts = read_model_facts(model_dir, dtype)
        config = self.complete_config(_with_model_defaults(config, self._facts))
        settings = config["sglang_cfg"]
        self._device = _resolve_device(settings["device"])
        self._kv_bytes_per_token = kv_bytes_per_token(model_dir, dtype)
        self.context_length = settings["context_length"] or self._facts.context_length
        self._client = httpx.Client(
            timeout=httpx.Timeout(settings["timeout_s"], connect=10.0),
            limits=httpx.Limits(max_connections=None),
        )
        self._pool = ThreadPoolExecutor(_MAX_REQUESTS_IN_FLIGHT, thread_name_prefix="gen-sglang")
        self._servers: list[SglangServer] = []
        self._fleet: ServerFleet[SglangServer] | None = None
        self._staged: StagedCheckpoint | None = None
        self._asleep = False
        self._next = 0
        self._next_lock = threading.Lock()
        absent = settings["load_format"] == "dummy"
        try:
            self._staged = StagedCheckpoint(model_dir, self._facts.specs, self._facts.optional)
            launch = self._start_servers(config, dtype)
            self._fleet = ServerFleet(
                self._servers,
                FleetHealth(len(self._servers), max_restarts=settings["max_replica_restarts"]),
                healing=settings["healing"],
                launch=launch,
                start_timeout_s=settings["start_timeout_s"],
                wedge_timeout_s=settings["wedge_timeout_s"],
                load=self._load_staged,
                checksum=self._weight_checksum,
                prepare=self._prepare_replacement,
                weights_absent=absent,
            )
            self._servers = self._fleet.servers  # one list: replacements are installed in it
        except BaseException:
            self._close()
            raise
        super().__init__(
            config,
            vocab_size=self._facts.vocab_size,
            context_limit=self.context_length,
            has_tokenizer=self._facts.has_tokenizer,
            model_specs=self._facts.specs,
            optional_weights=self._facts.optional,
            # Loads go to the staged checkpoint; the servers read it at the commit only.
            staged_weights=self._facts.specs.keys(),
            weights_absent="started with sglang_cfg.load_format 'dummy'" if absent else None,
        )

    @classmethod
    def complete_config(cls, config: Mapping[str, Any]) -> SglangConfig:
        for setting in ("batch_invariant", "lm_head_fp32", "return_routed_experts", "lora"):
            if config.get(setting):
                raise GenerationConfigError(
                    f"{setting} is set but SglangGeneration does not offer it yet; use backend "
                    f"'hf' or 'vllm', or leave {setting} out"
                )
        refuse_unoffered_speculation(config, cls.__name__, cls.speculative_methods)
        if (config.get("colocated") or {}).get("enabled"):
            raise GenerationConfigError(
                "colocated.enabled is true but SglangGeneration runs its servers as processes "
                "of their own; set it to false"
            )
        return complete_sglang_config(config)

    @property
    def capabilities(self) -> BackendCapabilities:
        on_gpu = self._device == "cuda"
        return BackendCapabilities(
            sleep=on_gpu,
            async_generation=True,
            weight_transports=frozenset({"shm", "state_dict"}),
            devices=(self._device,),
            score=True,
            stop_strings=self.has_tokenizer,
            in_flight_updates=True,
            token_streaming=True,
            refit_buffers=1,
            notes=(
                "weights reach the servers at the commit, as a checkpoint in shared memory that "
                "each loads (/update_weights_from_disk); nothing is written before",
                "'keep' updates retract running rows and recompute their KV cache with the new "
                "weights when they go on",
                "sampled rows are sampled inside the server by this project's decoding step "
                "(a custom logit processor), from a generator seeded with the row's seed",
            )
            + (() if on_gpu else ("finish_generation frees nothing on the CPU",)),
        )

    # ---- generation ----------------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        prompts = call.prompts.prompts()
        processed = self.config.get("logprobs_mode") == "processed"
        results: list[RowResult | None] = [None] * call.size
        streamed: set[int] = set()  # rows that handed the caller a token
        stop = threading.Event()

        def on(server: SglangServer, rows: list[int]) -> None:
            bodies, streams = [], []
            for index in rows:
                row = call.sampling.rows[index]
                budget = row.max_new_tokens
                if self.context_length is not None:
                    budget = min(budget, self.context_length - len(prompts[index]))
                rid = uuid.uuid4().hex
                bodies.append(
                    generate_body(
                        prompts[index], row, max_new_tokens=budget, processed=processed, rid=rid
                    )
                )
                stops = frozenset(row.stop_token_ids)
                streams.append(RowStream(row.top_logprobs, stops, sampled=not row.greedy))
            reported = [0] * len(rows)  # tokens reported through on_token, per row
            with contextlib.closing(self._chunks(server, batch_body(bodies))) as chunks:
                for chunk in chunks:
                    if stop.is_set() or control.cancelled.is_set():
                        return  # closing the stream ends its rows in SGLang
                    position = int(chunk.get("index", 0))
                    index, stream = rows[position], streams[position]
                    if results[index] is not None:
                        continue  # the row ended here at a stop token; this is SGLang's end
                    stream.add(chunk)
                    if stream.finish is not None:
                        results[index] = control.finished(index, stream.result())
                        if stream.stopped_here and not chunk["meta_info"].get("finish_reason"):
                            abort = {"rid": bodies[position]["rid"]}
                            self._post(server, "/abort_request", abort, json_answer=False)
                    elif control.on_token is not None:
                        # The newest token waits for the next chunk: if that one ends the row,
                        # it comes with the row's end, as the last token must.
                        while reported[position] < len(stream.token_ids) - 1:
                            _report_token(control, index, stream, reported[position])
                            reported[position] += 1
                            streamed.add(index)

        def unfinished(rows: list[int]) -> tuple[list[int], list[int]]:
            left = [i for i in rows if results[i] is None]
            return [i for i in left if i not in streamed], [i for i in left if i in streamed]

        self._on_servers(on, call.size, stop, unfinished)
        return results

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        scored: list[ScoredRow | None] = [None] * len(batch.sequences)

        def on(server: SglangServer, rows: list[int]) -> None:
            bodies = [
                score_body(batch.sequences[i], batch.prompt_lengths[i], top_logprobs) for i in rows
            ]
            answers = self._post(server, "/generate", batch_body(bodies))
            for index, answer in zip(rows, answers):
                response = len(batch.sequences[index]) - batch.prompt_lengths[index]
                scored[index] = scored_row(answer, response, top_logprobs)

        def unscored(rows: list[int]) -> tuple[list[int], list[int]]:
            return [i for i in rows if scored[i] is None], []

        self._on_servers(on, len(scored), threading.Event(), unscored)
        return [row for row in scored if row is not None]

    def _text_codec(self) -> SglangTextCodec | None:
        if not self.has_tokenizer:
            return None
        return SglangTextCodec(self._post_anywhere)

    def invalidate_kv_cache(self) -> bool:
        self._each_server("/flush_cache", None, json_answer=False)
        return True

    # ---- weight updates ------------------------------------------------------------------

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        mode = "retract" if in_flight == "keep" else "abort"
        fleet = self._fleet_()
        members = fleet.begin_update()
        try:
            self._each_server("/pause_generation", {"mode": mode}, replicas=members)
        except BaseException:
            fleet.update_ended()  # no transaction opened: neither commit nor abort follows
            raise

    def _load_handles(self, handles: Mapping[str, Any]) -> None:
        self._fleet_().staged_written()
        write_shared_weights(handles, self._staging().targets)

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._fleet_().staged_written()
        self._staging().write(state_dict)

    def _commit_update(self, version: int) -> None:
        """Every member of the update loads the staged checkpoint. A member that dies on the
        way is dropped from the update (healing); a refusal from a live one leaves every server
        on its old weights, or, when others took the new ones already, mixed weights."""
        fleet = self._fleet_()
        taken: list[str] = []
        try:
            for replica in fleet.members():
                server = fleet.servers[replica]
                try:
                    answer = self._load_staged_answer(server, version)
                except ServerLostError as exc:
                    self._report_lost(replica, exc)
                    continue
                except GenerationError as exc:
                    answer = {"success": False, "message": str(exc)}
                if not answer.get("success"):
                    why = f"{server.name} refused the new weights: {answer.get('message')}"
                    if taken:
                        raise MixedWeightsError(f"{why}; {', '.join(taken)} took them")
                    self._each_server("/continue_generation", {})
                    raise WeightUpdateError(f"{why}; every server keeps its old weights")
                taken.append(server.name)
            if not taken:
                raise WeightUpdateError(
                    "no SGLang server was left to take the new weights (every member of the "
                    "update died); retry the update once a replacement serves"
                )
            fleet.committed(version)
            self._each_server("/continue_generation", {})
        finally:
            fleet.update_ended()

    def _abort_update(self, written: bool) -> None:
        # Nothing reached a server before the commit: paused rows go on with the old weights.
        try:
            self._each_server("/continue_generation", {})
        finally:
            self._fleet_().update_ended()

    # ---- metrics -------------------------------------------------------------------------

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        """The fleet's: each server's state and verified weight version, the membership
        epoch, restarts, losses, rows re-run or lost, and healing times (totals over the
        backend's life, which ``clear`` leaves)."""
        return self._fleet_().metrics()

    # ---- life cycle ----------------------------------------------------------------------

    def _release(self) -> frozenset[Resource]:
        if self._device != "cuda":
            return frozenset()
        with self._fleet_().no_admissions():
            self._asleep = True
            self._each_server("/release_memory_occupation", {})
        return frozenset(RESOURCES)

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        if self._device == "cuda":
            with self._fleet_().no_admissions():
                self._asleep = False
                self._each_server("/resume_memory_occupation", {"tags": list(resources)})

    def _close(self) -> None:
        if self._fleet is not None:
            self._fleet.close()
            self._servers = self._fleet.servers
        for server in self._servers:
            server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        if self._staged is not None:
            self._staged.close()

    # ---- helpers -------------------------------------------------------------------------

    def _start_servers(self, config: SglangConfig, dtype: str) -> Callable[[int], SglangServer]:
        """Start every replica's server and wait for them; returns how to start replica ``i``'s
        replacement (the same command)."""
        settings = config["sglang_cfg"]
        cpu = self._device == "cpu"
        python = settings["python"]
        if python is None:
            if not cpu:
                raise BackendUnavailableError(
                    "sglang_cfg.python is not set and the managed SGLang environment is made "
                    "for the CPU only; on a GPU point sglang_cfg.python at an environment made "
                    "with `pip install sglang`"
                )
            python = str(managed_python())
        args = server_args(
            config,
            dtype,
            cpu=cpu,
            tokenizer=self._facts.has_tokenizer,
            kv_bytes=self._kv_bytes_per_token,
        )
        env = {"PYTHONPATH": ":".join(support_dir(cpu=cpu))}
        # Greedy rows report raw logprobs (sampled rows report RowSampler's own).
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        if cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        assert self._staged is not None
        model = str(serving_dir(Path(config["model_name"]), self._staged.root))

        def launch(replica: int) -> SglangServer:
            return SglangServer(python, model, args, env, name=f"replica {replica}")

        for replica in range(settings["num_replicas"]):
            self._servers.append(launch(replica))
        for server in self._servers:
            server.wait_ready(settings["start_timeout_s"])
        return launch

    def _on_servers(
        self,
        work: Callable[[SglangServer, list[int]], None],
        count: int,
        stop: threading.Event,
        unfinished: Callable[[list[int]], tuple[list[int], list[int]]],
    ) -> None:
        """Spread rows ``0 .. count - 1`` over the serving servers (round them, from where the
        last call stopped) and run ``work(server, its rows)`` for each on the request threads:
        one batched request per server, so SGLang schedules a call's rows together.

        A server lost under its request (healing): ``unfinished(its rows)`` says which of them
        handed the caller nothing (they run again at once on the serving servers) and which
        streamed tokens already (the call ends with ``RowLostError`` naming them). Any other
        failure ends the others (through ``stop``) and is raised.

        Raises:
            NoReplicaServingError: no server serves (healing), at the start or when rows move.
            RowLostError: rows that had streamed tokens were on a server that was lost.
            BackendBrokenError: a server was lost (fail-stop).
        """
        fleet = self._fleet_()
        running: dict[Future[None], tuple[int, SglangServer, list[int]]] = {}

        def send(rows: list[int]) -> None:
            members = fleet.members()
            if not members:
                raise fleet.no_replica_serving()
            with self._next_lock:
                first = self._next % len(members)
                self._next = first + len(rows)
            shares: dict[int, list[int]] = {}
            for k, index in enumerate(rows):
                shares.setdefault(members[(first + k) % len(members)], []).append(index)
            for replica, share in shares.items():
                server = fleet.servers[replica]
                running[self._pool.submit(work, server, share)] = (replica, server, share)

        try:
            send(list(range(count)))
            while running:
                done, _ = wait(running, return_when=FIRST_EXCEPTION)
                for future in done:
                    replica, server, rows = running.pop(future)
                    error = future.exception()
                    if error is None:
                        continue
                    if not isinstance(error, ServerLostError):
                        raise error
                    self._report_lost(replica, error)
                    rerun, lost = unfinished(rows)
                    if lost:
                        fleet.rows_lost += len(lost)
                        raise RowLostError(
                            f"row(s) {lost} had already streamed tokens when SGLang "
                            f"({server.name}) was lost ({error}): their tokens so far stand, "
                            "the rest cannot be made elsewhere without contradicting them; run "
                            "those rows again (the same seed gives the same tokens)",
                            tuple(lost),
                        )
                    if rerun:
                        fleet.rows_rerun += len(rerun)
                        send(rerun)
        finally:
            if running:
                stop.set()
                wait(running)

    def _chunks(self, server: SglangServer, body: dict[str, Any]) -> Any:
        """The parsed chunks of one streamed ``/generate``."""
        try:
            with (
                self._fleet_().streaming(server) as progress,
                self._client.stream("POST", server.url + "/generate", json=body) as response,
            ):
                if response.status_code != 200:
                    response.read()
                    raise _refused(server, response)
                # Lines are split on b"\n" alone: the chunks' text may hold other characters
                # that count as line breaks in str.splitlines (U+2028, U+0085, ...).
                pending = b""
                for data in response.iter_bytes():
                    progress()
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            return
                        yield json.loads(payload)
        except httpx.HTTPError as exc:
            raise self._lost(server, exc) from exc

    def _post(
        self,
        server: SglangServer,
        route: str,
        body: Any,
        *,
        json_answer: bool = True,
    ) -> Any:
        try:
            response = self._client.post(server.url + route, json=body)
        except httpx.HTTPError as exc:
            raise self._lost(server, exc) from exc
        if response.status_code != 200:
            raise _refused(server, response)
        return response.json() if json_answer else response.text

    def _each_server(
        self,
        route: str,
        body: Any,
        *,
        json_answer: bool = True,
        replicas: Sequence[int] | None = None,
    ) -> None:
        """Send one request to each serving server (or to ``replicas``, those of them still
        serving); a server found lost is reported (healing: it is left out)."""
        fleet = self._fleet_()
        for replica in fleet.members() if replicas is None else replicas:
            server = fleet.servers[replica]
            if not fleet.is_member(replica, server):
                continue  # lost since the list was made
            try:
                self._post(server, route, body, json_answer=json_answer)
            except ServerLostError as exc:
                self._report_lost(replica, exc)

    def _post_anywhere(self, route: str, body: Any) -> Any:
        """``_post`` to the first serving server, the next one if it is lost on the way."""
        fleet = self._fleet_()
        while True:
            members = fleet.members()
            if not members:
                raise fleet.no_replica_serving()
            server = fleet.servers[members[0]]
            try:
                return self._post(server, route, body)
            except ServerLostError as exc:
                self._report_lost(members[0], exc)

    def _lost(self, server: SglangServer, exc: BaseException) -> GenerationError:
        """The error for a request that failed on the way: ``ServerLostError`` when the server
        is gone (its process exited, or nothing listens on its port), else it did not answer
        in time."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=3.0)  # a killed server's connections close first
        died = server.died()
        if died is not None:
            return ServerLostError(f"{died} during a request:\n{server.log_tail()}", server)
        if isinstance(exc, httpx.ConnectError):
            return ServerLostError(
                f"the SGLang server ({server.name}, pid {server.process.pid}) runs but refuses "
                f"connections: {exc!r}",
                server,
            )
        return GenerationError(f"SGLang ({server.name}) did not answer: {exc!r}")

    def _report_lost(self, replica: int, error: ServerLostError) -> None:
        """Mark replica ``replica``'s server lost. Healing, it is replaced and this returns;
        fail-stop, the backend is broken.

        Raises:
            BackendBrokenError: fail-stop (``sglang_cfg.healing: false``).
        """
        fleet = self._fleet_()
        fleet.lose(replica, error.server, str(error))
        if not fleet.healing:
            raise BackendBrokenError(str(error)) from error

    # ---- the fleet's replacements ----------------------------------------------------------

    def _load_staged_answer(self, server: SglangServer, version: int) -> Any:
        """``/update_weights_from_disk`` of the staged checkpoint into ``server``, labelled
        ``version``: SGLang's answer."""
        request = {
            "model_path": str(self._staging().dir),
            "weight_version": str(version),
            "load_format": "auto",  # the file holds real weights, whatever the server began with
        }
        return self._post(server, "/update_weights_from_disk", request)

    def _load_staged(self, server: SglangServer, version: int) -> None:
        """A replacement takes the committed weights from the staged checkpoint.

        Raises:
            WeightUpdateError: SGLang refused them.
        """
        answer = self._load_staged_answer(server, version)
        if not answer.get("success"):
            raise WeightUpdateError(
                f"{server.name} refused the staged weights of version {version}: "
                f"{answer.get('message')}"
            )

    def _weight_checksum(self, server: SglangServer) -> str:
        """SGLang's checksum of every parameter ``server`` holds (``/weights_checker``)."""
        answer = self._post(server, "/weights_checker", {"action": "checksum"})
        checksum = answer.get("per_engine_checksum")
        if not answer.get("success") or not checksum:
            raise GenerationError(
                f"SGLang ({server.name}) gave no weight checksum: {answer.get('message')}"
            )
        return str(checksum)

    def _prepare_replacement(self, server: SglangServer) -> None:
        """A replacement admitted while the backend sleeps sleeps too."""
        if self._asleep:
            self._post(server, "/release_memory_occupation", {})

    def _fleet_(self) -> ServerFleet[SglangServer]:
        if self._fleet is None:
            raise GenerationError("this SglangGeneration's servers are not started")
        return self._fleet

    def _staging(self) -> StagedCheckpoint:
        if self._staged is None:
            raise WeightUpdateError("this SglangGeneration is shut down; build a new one")
        return self._staged


def _report_token(control: RowControl, row: int, stream: RowStream, j: int) -> None:
    assert control.on_token is not None
    k = stream.top_logprobs
    control.on_token(
        row,
        stream.token_ids[j],
        stream.logprobs[j],
        stream.topk_ids[j] if k else [],
        stream.topk_logprobs[j] if k else [],
    )


def _refused(server: SglangServer, response: httpx.Response) -> GenerationError:
    text = response.text[:1000]
    if response.status_code == 400:
        return GenerationInputError(f"SGLang ({server.name}) refused the request: {text}")
    return GenerationError(f"SGLang ({server.name}) answered {response.status_code}: {text}")


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(
            "sglang_cfg.device is 'cuda' but this machine has no CUDA device; use 'cpu' or 'auto'"
        )
    return device


def _with_model_defaults(config: Mapping[str, Any], facts: ModelFacts) -> dict[str, Any]:
    """``config`` with ``pad_token_id`` and ``stop_token_ids`` taken from the model when left
    out."""
    out = {**GENERATION_CONFIG_DEFAULTS, **config}
    if out.get("stop_token_ids") is None and facts.eos_token_id is not None:
        out["stop_token_ids"] = [facts.eos_token_id]
    if out.get("pad_token_id") is None:
        out["pad_token_id"] = (
            facts.pad_token_id if facts.pad_token_id is not None else (facts.eos_token_id)
        )
    if out.get("pad_token_id") is None:
        raise GenerationConfigError(
            f"pad_token_id must be set: model {config.get('model_name')!r} names no pad or eos "
            "token"
        )
    return out
