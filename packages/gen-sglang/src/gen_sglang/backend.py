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
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import torch
from gen_interface import (
    BackendBrokenError,
    BackendCapabilities,
    BackendUnavailableError,
    GenerationBackend,
    GenerationCall,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    InFlight,
    MixedWeightsError,
    RowResult,
    WeightUpdateError,
)
from gen_interface.config import GENERATION_CONFIG_DEFAULTS, resolve_dtype
from gen_interface.lifecycle import RESOURCES, Resource
from gen_interface.scoring import ScoreBatch, ScoredRow
from gen_interface.stepping import RowControl
from gen_interface.weights.consumer import write_shared_weights

from gen_sglang.checkpoint import ModelFacts, StagedCheckpoint, read_model_facts
from gen_sglang.config import SglangConfig, complete_sglang_config
from gen_sglang.environment import managed_python, support_dir
from gen_sglang.rows import RowStream, generate_body, score_body, scored_row
from gen_sglang.server import SglangServer

__all__ = ["SglangGeneration"]

#: Rows in flight at once per backend; more wait for a thread.
_MAX_ROWS_IN_FLIGHT = 256


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
        self.context_length = settings["context_length"] or self._facts.context_length
        self._client = httpx.Client(
            timeout=httpx.Timeout(settings["timeout_s"], connect=10.0),
            limits=httpx.Limits(max_connections=None),
        )
        self._pool = ThreadPoolExecutor(_MAX_ROWS_IN_FLIGHT, thread_name_prefix="gen-sglang")
        self._servers: list[SglangServer] = []
        self._staged: StagedCheckpoint | None = None
        self._next = 0
        self._next_lock = threading.Lock()
        try:
            self._start_servers(config, dtype)
            self._staged = StagedCheckpoint(model_dir, self._facts.specs, self._facts.optional)
        except BaseException:
            self._close()
            raise
        absent = settings["load_format"] == "dummy"
        super().__init__(
            config,
            vocab_size=self._facts.vocab_size,
            context_limit=self.context_length,
            has_tokenizer=self._facts.has_tokenizer,
            model_specs=self._facts.specs,
            optional_weights=self._facts.optional,
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
                "sampled rows in 'raw' mode use SGLang's own top-k/top-p/min-p sampler; "
                "'processed' rows sample from this project's distribution",
            )
            + (() if on_gpu else ("finish_generation frees nothing on the CPU",)),
        )

    # ---- generation ----------------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        prompts = call.prompts.prompts()
        processed = self.config.get("logprobs_mode") == "processed"
        first = self._take_servers(call.size)
        results: list[RowResult | None] = [None] * call.size
        stop = threading.Event()

        def one(index: int) -> None:
            row = call.sampling.rows[index]
            budget = row.max_new_tokens
            if self.context_length is not None:
                budget = min(budget, self.context_length - len(prompts[index]))
            body = generate_body(prompts[index], row, max_new_tokens=budget, processed=processed)
            server = self._servers[(first + index) % len(self._servers)]
            stream = RowStream(row.top_logprobs)
            with contextlib.closing(self._chunks(server, body)) as chunks:
                for chunk in chunks:
                    if stop.is_set() or control.cancelled.is_set():
                        return  # closing the stream ends the row in SGLang
                    before = len(stream.token_ids)
                    stream.add(chunk)
                    if control.on_token is not None and stream.finish is None:
                        for j in range(before, len(stream.token_ids)):
                            _report_token(control, index, stream, j)
            results[index] = control.finished(index, stream.result())

        self._all(one, range(call.size), stop)
        return results

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        rows: list[ScoredRow | None] = [None] * len(batch.sequences)
        first = self._take_servers(len(rows))

        def one(index: int) -> None:
            sequence, prompt = batch.sequences[index], batch.prompt_lengths[index]
            server = self._servers[(first + index) % len(self._servers)]
            answer = self._post(server, "/generate", score_body(sequence, prompt, top_logprobs))
            rows[index] = scored_row(answer, len(sequence) - prompt, top_logprobs)

        self._all(one, range(len(rows)), threading.Event())
        return [row for row in rows if row is not None]

    def invalidate_kv_cache(self) -> bool:
        for server in self._servers:
            self._post(server, "/flush_cache", None, json_answer=False)
        return True

    # ---- weight updates ------------------------------------------------------------------

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        mode = "retract" if in_flight == "keep" else "abort"
        self._each_server("/pause_generation", {"mode": mode})

    def _load_handles(self, handles: Mapping[str, Any]) -> None:
        write_shared_weights(handles, self._staging().targets)

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._staging().write(state_dict)

    def _commit_update(self, version: int) -> None:
        staged = self._staging()
        request = {"model_path": str(staged.dir), "weight_version": str(version)}
        taken: list[str] = []
        for server in self._servers:
            try:
                answer = self._post(server, "/update_weights_from_disk", request)
            except GenerationError as exc:
                answer = {"success": False, "message": str(exc)}
            if not answer.get("success"):
                why = f"{server.name} refused the new weights: {answer.get('message')}"
                if taken:
                    raise MixedWeightsError(f"{why}; {', '.join(taken)} took them")
                self._each_server("/continue_generation", {})
                raise WeightUpdateError(f"{why}; every server keeps its old weights")
            taken.append(server.name)
        self._each_server("/continue_generation", {})

    def _abort_update(self, written: bool) -> None:
        # Nothing reached a server before the commit: paused rows go on with the old weights.
        self._each_server("/continue_generation", {})

    # ---- life cycle ----------------------------------------------------------------------

    def _release(self) -> frozenset[Resource]:
        if self._device != "cuda":
            return frozenset()
        self._each_server("/release_memory_occupation", {})
        return frozenset(RESOURCES)

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        if self._device == "cuda":
            self._each_server("/resume_memory_occupation", {"tags": list(resources)})

    def _close(self) -> None:
        for server in self._servers:
            server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        if self._staged is not None:
            self._staged.close()

    # ---- helpers -------------------------------------------------------------------------

    def _start_servers(self, config: SglangConfig, dtype: str) -> None:
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
        args = _server_args(config, dtype, cpu=cpu, tokenizer=self._facts.has_tokenizer)
        env = {"PYTHONPATH": ":".join(support_dir(cpu=cpu))}
        if config.get("logprobs_mode", "raw") == "raw":
            env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        if cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        for replica in range(settings["num_replicas"]):
            self._servers.append(
                SglangServer(python, config["model_name"], args, env, name=f"replica {replica}")
            )
        for server in self._servers:
            server.wait_ready(settings["start_timeout_s"])

    def _take_servers(self, rows: int) -> int:
        """The replica of a call's first row; rows go round the replicas from there."""
        with self._next_lock:
            first = self._next
            self._next = (self._next + rows) % len(self._servers)
        return first

    def _all(self, work: Callable[[int], None], items: range, stop: threading.Event) -> None:
        """``work(i)`` for every item on the row threads; the first failure ends the others
        (through ``stop``) and is raised."""
        futures: list[Future[None]] = [self._pool.submit(work, i) for i in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            stop.set()
            wait(futures)
            raise failed[0].exception()  # type: ignore[misc]

    def _chunks(self, server: SglangServer, body: dict[str, Any]) -> Any:
        """The parsed chunks of one streamed ``/generate``."""
        try:
            with self._client.stream("POST", server.url + "/generate", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise _refused(server, response)
                # Lines are split on b"\n" alone: the chunks' text may hold other characters
                # that count as line breaks in str.splitlines (U+2028, U+0085, ...).
                pending = b""
                for data in response.iter_bytes():
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

    def _each_server(self, route: str, body: Any) -> None:
        for server in self._servers:
            self._post(server, route, body)

    def _lost(self, server: SglangServer, exc: BaseException) -> GenerationError:
        """The error for a request that failed on the way: the server died (the backend is
        broken), or it did not answer in time."""
        died = server.died()
        if died is None:
            server.process.poll()
            died = server.died()
        if died is not None:
            return BackendBrokenError(f"{died} during a request:\n{server.log_tail()}")
        return GenerationError(f"SGLang ({server.name}) did not answer: {exc!r}")

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


def _server_args(config: SglangConfig, dtype: str, *, cpu: bool, tokenizer: bool) -> list[str]:
    settings = config["sglang_cfg"]
    args = ["--dtype", dtype, "--weight-version", "0", "--enable-custom-logit-processor"]
    args += ["--load-format", settings["load_format"], "--random-seed", "0"]
    if cpu:
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
    fraction = settings["mem_fraction_static"] or (0.05 if cpu else None)
    if fraction is not None:
        args += ["--mem-fraction-static", str(fraction)]
    total = settings["max_total_tokens"] or (4096 if cpu else None)
    if total is not None:
        args += ["--max-total-tokens", str(total)]
    if settings["context_length"] is not None:
        args += ["--context-length", str(settings["context_length"])]
    if not tokenizer:
        args.append("--skip-tokenizer-init")
    return args + list(settings["extra_args"])


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
