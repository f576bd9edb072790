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
that had handed nothing to the caller run again on a serving server (``routing.RowRouter``).
Every request goes through ``client.FleetClient``; an update's steps against the servers are
``server_weights.ServerWeights``. This class ties them to the shared base.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

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
    BackendCapabilities,
    BackendUnavailableError,
    GenerationConfigError,
    GenerationError,
    InFlight,
    WeightUpdateError,
)
from gen_interface.config import GENERATION_CONFIG_DEFAULTS

from gen_sglang.checkpoint import ModelFacts, StagedCheckpoint, read_model_facts, serving_dir
from gen_sglang.client import FleetClient
from gen_sglang.config import SglangConfig, complete_sglang_config
from gen_sglang.environment import managed_python
from gen_sglang.fleet import ServerFleet
from gen_sglang.kv_cache import kv_bytes_per_token
from gen_sglang.routing import RowRouter
from gen_sglang.rows import RowStream, batch_body, generate_body, score_body, scored_row
from gen_sglang.server import SglangServer
from gen_sglang.server_args import server_args, server_env
from gen_sglang.server_weights import ServerWeights
from gen_sglang.text import SglangTextCodec

__all__ = ["SglangGeneration"]


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
        self._chunk_tokens = settings["chunk_tokens"]
        self._client = FleetClient(self._fleet_, settings["timeout_s"])
        self._router = RowRouter(self._fleet_)
        self._servers: list[SglangServer] = []
        self._fleet: ServerFleet[SglangServer] | None = None
        self._staged: StagedCheckpoint | None = None
        self._asleep = False
        absent = settings["load_format"] == "dummy"
        try:
            self._staged = StagedCheckpoint(model_dir, self._facts.specs, self._facts.optional)
            self._server_weights = ServerWeights(self._client, self._staged.dir)
            launch = self._start_servers(config, dtype)
            self._fleet = ServerFleet(
                self._servers,
                FleetHealth(len(self._servers), max_restarts=settings["max_replica_restarts"]),
                healing=settings["healing"],
                launch=launch,
                start_timeout_s=settings["start_timeout_s"],
                wedge_timeout_s=settings["wedge_timeout_s"],
                load=self._server_weights.load,
                checksum=self._server_weights.checksum,
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
                        prompts[index],
                        row,
                        max_new_tokens=budget,
                        processed=processed,
                        rid=rid,
                        chunk_tokens=1 if control.on_token is not None else self._chunk_tokens,
                    )
                )
                stops = frozenset(row.stop_token_ids)
                streams.append(RowStream(row.top_logprobs, stops, sampled=not row.greedy))
            reported = [0] * len(rows)  # tokens reported through on_token, per row
            with contextlib.closing(self._client.chunks(server, batch_body(bodies))) as chunks:
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
                            self._client.post(server, "/abort_request", abort, json_answer=False)
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

        self._router.run(on, call.size, stop, unfinished)
        return results

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        scored: list[ScoredRow | None] = [None] * len(batch.sequences)

        def on(server: SglangServer, rows: list[int]) -> None:
            bodies = [
                score_body(batch.sequences[i], batch.prompt_lengths[i], top_logprobs) for i in rows
            ]
            answers = self._client.post(server, "/generate", batch_body(bodies))
            for index, answer in zip(rows, answers):
                response = len(batch.sequences[index]) - batch.prompt_lengths[index]
                scored[index] = scored_row(answer, response, top_logprobs)

        def unscored(rows: list[int]) -> tuple[list[int], list[int]]:
            return [i for i in rows if scored[i] is None], []

        self._router.run(on, len(scored), threading.Event(), unscored)
        return [row for row in scored if row is not None]

    def _text_codec(self) -> SglangTextCodec | None:
        if not self.has_tokenizer:
            return None
        return SglangTextCodec(self._client.post_anywhere)

    def invalidate_kv_cache(self) -> bool:
        self._client.each_server("/flush_cache", None, json_answer=False)
        return True

    # ---- weight updates ------------------------------------------------------------------

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        self._server_weights.pause(in_flight)

    def _load_handles(self, handles: Mapping[str, Any]) -> None:
        self._fleet_().staged_written()
        write_shared_weights(handles, self._staging().targets)

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._fleet_().staged_written()
        self._staging().write(state_dict)

    def _commit_update(self, version: int) -> None:
        self._server_weights.commit(version)

    def _abort_update(self, written: bool) -> None:
        self._server_weights.resume()

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
            self._client.each_server("/release_memory_occupation", {})
        return frozenset(RESOURCES)

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        if self._device == "cuda":
            with self._fleet_().no_admissions():
                self._asleep = False
                self._client.each_server("/resume_memory_occupation", {"tags": list(resources)})

    def _prepare_replacement(self, server: SglangServer) -> None:
        """A replacement admitted while the backend sleeps sleeps too."""
        if self._asleep:
            self._client.post(server, "/release_memory_occupation", {})

    def _close(self) -> None:
        if self._fleet is not None:
            self._fleet.close()
            self._servers = self._fleet.servers
        for server in self._servers:
            server.stop()
        self._router.close()
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
        env = server_env(settings, cpu=cpu)
        assert self._staged is not None
        model = str(serving_dir(Path(config["model_name"]), self._staged.root))

        def launch(replica: int) -> SglangServer:
            return SglangServer(python, model, args, env, name=f"replica {replica}")

        for replica in range(settings["num_replicas"]):
            self._servers.append(launch(replica))
        for server in self._servers:
            server.wait_ready(settings["start_timeout_s"])
        return launch

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
