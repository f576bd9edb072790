"""A stand-in for vLLM's engine where the CPU build cannot go: sleep mode and tensor parallelism.

``FakeEngine`` follows ``gen_vllm.engine.EngineProtocol`` and, behind it, the contracts vLLM
documents for CUDA (read in vLLM 0.32's ``gpu_worker.py`` and ``device_allocator/cumem.py``):

- **Sleep mode** needs ``enable_sleep_mode``; level 1 backs the weights up to host memory and
  unmaps them and the KV cache; level 2 unmaps both without a backup. ``wake_up(tags)`` maps the
  named memory again and, for weights after level 1, copies the backup back (over whatever was
  written meanwhile). Writing weights or stepping while the memory is unmapped fails loudly, as
  the real allocator's illegal-address fault would.
- **Tensor parallelism**: each rank holds its own shard of every weight (dim 0 split across
  ranks), loads through the real ``UpdatableVllmInternalWorker`` extension, and reports its own
  checksum; the engine computes with the shards gathered back.

It plugs into the real ``VllmGenerationWorker`` / ``ReplicaSet`` / ``VllmGeneration`` (pass
``engine_factory=FakeEngineFactory(...)``); tokens come from the tiny model's real forward pass,
so outputs change with the weights exactly as a real engine's would.

- **CPU weight packing**: one weight of every rank is "packed" as vLLM's CPU linear layers
  pack theirs: its parameter is emptied and only the layer's ``cpu_linear`` computes with it, so
  parameter checksums cannot see it.

Faults for failure tests: ``hang_in`` (method names that never return); ``arm_corrupt_load``
(the next engine to load an update keeps one rank's shard wrong, a plain or the packed one);
``set_fault(log_dir, "rows")`` (every step ends its requests with vLLM's ``"error"`` finish
reason), ``set_fault(log_dir, "step")`` (every step raises, as a failing kernel would) and
``set_fault(log_dir, "wedge", pid=...)`` (that engine stops stepping, alive and silent, as a
wedged one does, until the fault is off), ``set_fault(log_dir, "load")`` (each weight load
stalls after logging its ``update`` event, until the fault is off: a seam for killing an
engine mid-load);
``batch_variant`` (each request's logits shift in the last bits with the number of requests
running beside it, as GPU kernels' results shift with batch shape).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from gen_backend_kit.row_sampling import RowSampling
from gen_backend_kit.sampling import select_next_tokens
from gen_backend_kit.scoring import scored_row
from gen_interface.weights.collective import CollectiveEndpoint, join_weight_group
from gen_testkit.routing import reference_routing
from gen_vllm.engine import EngineLimits, EngineStep, StepOutput
from gen_vllm.extension import UpdatableVllmInternalWorker
from gen_vllm.messages import TokenDelta
from gen_vllm.receive import receive_load, whole_tensors
from gen_vllm.staging import EngineLoads

_GARBAGE = float("nan")  # what unmapped, re-mapped memory reads as


class FakeEngineFactory:
    """Builds one ``FakeEngine`` per worker; picklable, so Ray ships it to the actors.

    Args:
        log_dir: where each engine appends its events (``<pid>.jsonl``) for tests to read.
        hang_in: engine methods (``"sleep"``, ``"wake_up"``, ``"reset_prefix_cache"``,
            ``"update"``) that block forever when called.

    ``arm_corrupt_load(log_dir)`` makes the next engine to load an update write a wrong shard.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        hang_in: frozenset[str] = frozenset(),
        batch_variant: bool = False,
    ):
        self.log_dir = str(log_dir)
        self.hang_in = frozenset(hang_in)
        self.batch_variant = batch_variant

    def __call__(self, model: str, engine_args: dict[str, Any]) -> FakeEngine:
        return FakeEngine(model, engine_args, self)


_ARMED = "corrupt.armed"


def arm_corrupt_load(log_dir: str | os.PathLike[str], *, packed: bool = False) -> None:
    """From now on, the first engine logging to ``log_dir`` to load an update writes a wrong shard
    on its last rank (once, across processes): the packed weight's when ``packed``."""
    (Path(log_dir) / _ARMED).write_text("packed" if packed else "plain")


def set_fault(
    log_dir: str | os.PathLike[str], fault: str, on: bool = True, pid: int | None = None
) -> None:
    """Turn a fault of every engine logging to ``log_dir`` (or of the one in process ``pid``)
    on or off: ``"rows"``, ``"step"``, ``"wedge"`` or ``"load"``."""
    flag = Path(log_dir) / (f"fault.{fault}" if pid is None else f"fault.{fault}.{pid}")
    if on:
        flag.touch()
    else:
        flag.unlink(missing_ok=True)


def read_events(log_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event every fake engine logged, in file then line order."""
    events = []
    for path in sorted(Path(log_dir).glob("*.jsonl")):
        events.extend(json.loads(line) for line in path.read_text().splitlines())
    return events


class FakeEngine:
    """One engine: ``tensor_parallel_size`` ranks in this process, a tiny model's forward pass."""

    def __init__(self, model: str, engine_args: dict[str, Any], factory: FakeEngineFactory):
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        self._factory = factory
        self._log_path = Path(factory.log_dir) / f"{os.getpid()}.jsonl"
        self.sleep_enabled = bool(engine_args.get("enable_sleep_mode"))
        self.processed = engine_args.get("logprobs_mode") == "processed_logprobs"
        config = AutoConfig.from_pretrained(model)
        # vLLM's own routed-experts option (GPU, Model Runner V2): each finished request's
        # routing of every position read, [prompt + generated - 1, layers, top_k]
        self.routed_top_k = (
            int(config.num_experts_per_tok)
            if engine_args.get("enable_return_routed_experts")
            else 0
        )
        # from_pretrained: transformers converts the checkpoint's layout where its own differs
        # (an MoE's per-expert weights into fused ones); updates load by checkpoint names, which
        # covers the dense models the fake's update tests use
        self._model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        checkpoint = load_file(str(Path(model) / "model.safetensors"))
        tp = int(engine_args.get("tensor_parallel_size", 1))
        bundles = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "").split(",")
        self.ranks = [
            FakeRank(rank, tp, model, checkpoint, bundles[rank] if tp > 1 else "")
            for rank in range(tp)
        ]
        self.limits = EngineLimits(
            vocab_size=int(config.vocab_size),
            max_model_len=int(engine_args.get("max_model_len") or config.max_position_embeddings),
            dtype="float32",
            model=model,
        )
        self.kv_mapped = True
        self.paused = False
        self.version = 0  # the label of the weights that produce the next tokens
        self._requests: dict[str, _Request] = {}
        self._loaded_version = -1
        self._log(
            "start",
            tp=tp,
            sleep_enabled=self.sleep_enabled,
            routed_experts=bool(self.routed_top_k),
            v2_runner=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        )

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: list[int], params: dict[str, Any], stream: bool = False
    ) -> None:
        if params.get("stop"):
            raise NotImplementedError("the fake engine has no tokenizer for stop strings")
        self._requests[request_id] = _Request(prompt, params, stream)

    def step(self) -> EngineStep:
        if self.paused or not self._requests:
            return EngineStep([], [])
        self._check_mapped("step")
        while self._fault("wedge"):  # alive, silent, holding its rows
            time.sleep(0.05)
        if self._fault("step"):
            raise RuntimeError("a kernel failed (the fake engine's step fault is set)")
        model = self._current_model()
        deltas, ended = [], []
        shift = len(self._requests) - 1 if self._factory.batch_variant else 0
        with torch.inference_mode():
            for request_id, request in list(self._requests.items()):
                output = request.advance(request_id, model, self.processed, shift)
                if self._fault("rows"):
                    output = StepOutput(request_id, output.token_ids, output.logprobs, "error")
                request.record(output, self.version)
                if output.finish_reason is not None and self.routed_top_k:
                    read = request.sequence[:-1]  # the last token was sampled, never fed
                    routing = reference_routing(model, read, self.routed_top_k).experts
                    output = dataclasses.replace(output, routed_experts=routing.numpy())
                if output.finish_reason is not None:
                    del self._requests[request_id]
                # as gen_vllm.engine's outputs: one with every token when a request ends
                # (vLLM's FINAL_ONLY), and each earlier step's tokens for one that streams
                if output.finish_reason is not None:
                    ended.append(request.whole(output))
                elif request.stream:
                    deltas.append(
                        TokenDelta(
                            request_id,
                            output.token_ids,
                            output.logprobs,
                            output.topk_ids or [],
                            output.topk_logprobs or [],
                        )
                    )
        return EngineStep(deltas, ended)

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        finals = []
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            finals.append(request.whole(StepOutput(request_id, [], [], "abort")))
        return finals

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- control -----------------------------------------------------------------------------

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "update_weights":
            self._maybe_hang("update")
            self._log("update", mapped=[r.weights_mapped for r in self.ranks])
            while self._fault("load"):  # a load that stalls, holding the update open
                time.sleep(0.05)
            armed = Path(self._factory.log_dir) / _ARMED
            if armed.exists() and self._claim("corrupt"):
                self.ranks[-1].corrupt_next_load = armed.read_text()
        return [getattr(rank, method)(*args) for rank in self.ranks]

    def reset_prefix_cache(self) -> bool:
        self._maybe_hang("reset_prefix_cache")
        self._log("reset_prefix_cache")
        return not self._requests

    def sleep(self, level: int) -> None:
        self._maybe_hang("sleep")
        if not self.sleep_enabled:
            raise RuntimeError("Sleep mode is not enabled: start the engine with enable_sleep_mode")
        self._log("sleep", level=level)
        for rank in self.ranks:
            rank.sleep(level)
        self.kv_mapped = False

    def wake_up(self, tags: list[str] | None) -> None:
        self._maybe_hang("wake_up")
        self._log("wake_up", tags=tags)
        for rank in self.ranks:
            rank.wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self.kv_mapped = True

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def set_weight_version(self, version: int) -> None:
        self._log("version", version=version)
        self.version = version

    def shutdown(self) -> None:
        self._log("shutdown")
        self._requests.clear()

    # ---- internals ---------------------------------------------------------------------------

    def _current_model(self) -> torch.nn.Module:
        version = sum(rank.version for rank in self.ranks)
        if version != self._loaded_version:
            first = self.ranks[0]
            full = {
                name: torch.cat([r.shards[name] for r in self.ranks])
                if first.split[name]
                else shard
                for name, shard in first.shards.items()
            }
            self._model.load_state_dict(full, strict=False)
            self._model.tie_weights()
            self._loaded_version = version
        return self._model

    def _fault(self, name: str) -> bool:
        log_dir = Path(self._factory.log_dir)
        return (log_dir / f"fault.{name}").exists() or (
            log_dir / f"fault.{name}.{os.getpid()}"
        ).exists()

    def _check_mapped(self, what: str) -> None:
        if not self.kv_mapped or not all(rank.weights_mapped for rank in self.ranks):
            raise RuntimeError(
                f"CUDA error: an illegal memory access was encountered ({what} "
                "while the engine sleeps)"
            )

    def _maybe_hang(self, method: str) -> None:
        if method in self._factory.hang_in:
            self._log("hang", method=method)
            time.sleep(3600)

    def _claim(self, what: str) -> bool:
        """True for the first engine, across processes, to claim ``what``."""
        try:
            os.close(os.open(Path(self._factory.log_dir) / f"{what}.claim", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def _log(self, event: str, **fields: Any) -> None:
        with self._log_path.open("a") as log:
            log.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


class FakeRank(UpdatableVllmInternalWorker):
    """One tensor-parallel rank: the real worker extension over a shard of every weight."""

    def __init__(
        self, rank: int, tp: int, model: str, checkpoint: dict[str, torch.Tensor], bundle: str
    ):
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_config = type("ModelConfig", (), {"model": model, "dtype": torch.float32})()
        self.split = {
            n: tp > 1 and t.dim() > 0 and t.shape[0] % tp == 0 for n, t in checkpoint.items()
        }
        self._tp = tp
        self.shards = {n: self._shard(n, t).clone() for n, t in checkpoint.items()}
        self.model_runner = _FakeModelRunner(self)
        self.weights_mapped = True
        #: The name of the weight CPU packing would hide from parameter checksums.
        self.packed = sorted(n for n, t in checkpoint.items() if t.dim() == 2)[-1]
        self.corrupt_next_load: str | None = None  # "plain" or "packed": corrupt the next load
        self._updating = False
        self.weight_transfer_engine = _FakeTransferEngine()
        self.weight_transfer_engine.load = self.load
        self.version = 0
        self._backup: dict[str, torch.Tensor] | None = None
        # Like a GPU UUID: which placement group and bundle (or visible GPU) this rank holds.
        where = bundle or os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self._device_id = f"GPU-fake-{_placement_group_id()}-{where}-r{rank}-{os.getpid()}"

    def report_device_id(self) -> str:
        return self._device_id

    def capture_routed_experts(self, native: bool = False) -> list[int] | str:
        """The real extension's answer for a capture (the fake's model has no vLLM MoE layer);
        for vLLM's own option, the model config's MoE shape, as ``moe_shape`` reads it."""
        if not native:
            return super().capture_routed_experts(native)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_config.model)
        if not getattr(config, "num_experts_per_tok", 0):
            return "the model has no MoE layer"
        return [config.num_hidden_layers, config.num_experts_per_tok, config.num_experts]

    # vLLM's Worker side of a weight update (gpu_worker.py), around this project's receiving
    # code (receive.py), as the real transfer engine runs it.

    def start_weight_update(self) -> None:
        if self._updating:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self._updating = True
        self.weight_transfer_engine.received = []
        self.weight_transfer_engine.staged = False
        self.weight_transfer_engine.loads.begin()
        if self.weight_transfer_engine.committed is not None:
            self.weight_transfer_engine.committed.begin()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if not self._updating:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        engine = self.weight_transfer_engine
        for bucket in receive_load(update_info, device_uuid=None, group=engine.group):
            if engine.committed is not None:  # staged; loaded while deltas (staging.py)
                engine.staged = True
                now = engine.loads.stage(engine.committed, bucket.entries)
                if now:
                    self.load(now)
            else:
                self.load(whole_tensors(bucket.entries))
            engine.received.append(bucket.checksum)

    def finish_weight_update(self) -> None:
        if not self._updating:
            raise RuntimeError("finish_weight_update called without a matching start")
        self._updating = False
        engine = self.weight_transfer_engine
        if engine.staged and engine.committed is not None:
            engine.staged = False
            rest = engine.loads.remaining(engine.committed)
            if rest:
                self.load(rest)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        endpoint = CollectiveEndpoint(**init_info["endpoint"])
        self.weight_transfer_engine.group = join_weight_group(
            endpoint, init_info["rank"] + self.rank, torch.device("cpu")
        )

    def load(self, tensors: Any) -> None:
        if not self.weights_mapped:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (weights written while "
                "asleep)"
            )
        for name, tensor in tensors:
            if name in self.shards:
                self.shards[name].copy_(self._shard(name, tensor))
        if self.corrupt_next_load:  # a load that went wrong on this rank only
            name = self.packed if self.corrupt_next_load == "packed" else sorted(self.shards)[0]
            self.shards[name].add_(1.0)
            self.corrupt_next_load = None
        self.version += 1

    def sleep(self, level: int) -> None:
        self._backup = {n: t.clone() for n, t in self.shards.items()} if level == 1 else None
        for shard in self.shards.values():
            shard.fill_(_GARBAGE)
        self.weights_mapped = False
        self.version += 1

    def wake_up(self, tags: list[str] | None) -> None:
        if (tags is None or "weights" in tags) and not self.weights_mapped:
            self.weights_mapped = True
            if self._backup is not None:
                for name, shard in self.shards.items():
                    shard.copy_(self._backup[name])
                self._backup = None
            self.version += 1

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not self.split.get(name, False):
            return tensor
        return tensor.chunk(self._tp)[self.rank]


class _FakeTransferEngine:
    """What the extension reads of the transfer engine (``transfer.py``)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.group: Any = None
        self.committed: Any = None
        self.staged = False
        self.loads = EngineLoads()
        self.load: Any = None  # the rank's own load, set by the rank

    def drop_staged(self) -> None:
        if self.committed is not None:
            restore = self.loads.drop(self.committed)
            if restore is None:
                raise RuntimeError("the engine's weights are unknown")
            if restore:
                self.load(restore)
        self.staged = False


class _FakeModelRunner:
    """What the extension uses of vLLM's model runner: ``get_model``."""

    def __init__(self, rank: FakeRank):
        self._rank = rank

    def get_model(self) -> torch.nn.Module:
        module = torch.nn.Module()
        for name, shard in self._rank.shards.items():
            if name != self._rank.packed:
                module.register_buffer(name.replace(".", "__"), shard)
        module.add_module("packed", _PackedLinear(self._rank.shards[self._rank.packed]))
        return module


class _PackedLinear(torch.nn.Module):
    """A linear layer as vLLM's CPU build leaves it: the weight parameter emptied, the values
    only reachable through ``cpu_linear`` (here a plain matmul over the live shard)."""

    def __init__(self, shard: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=shard.dtype), requires_grad=False)
        self.input_size_per_partition = shard.shape[1]
        self.params_dtype = shard.dtype
        self.cpu_linear = lambda x, weight, bias: x @ shard.T


class _Request:
    """One request's state: its sequence, its generator, what it asked for, what it made."""

    def __init__(self, prompt: list[int], params: dict[str, Any], stream: bool = False):
        self.sequence = list(prompt)
        self.prompt_length = len(prompt)
        self.params = params
        self.stream = stream
        self.generated = 0
        seed = params.get("seed")
        self.generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        self.made: list[StepOutput] = []  # every step's output
        self.versions: list[int] = []  # the weight version of each token

    def record(self, output: StepOutput, version: int) -> None:
        self.made.append(output)
        self.versions.extend([version] * len(output.token_ids))

    def whole(self, last: StepOutput) -> StepOutput:
        """One output with every token made, ended as ``last`` says (vLLM's FINAL_ONLY)."""
        top = bool(int(self.params.get("logprobs") or 0))
        first = self.made[0] if self.made else last
        return dataclasses.replace(
            last,
            token_ids=[t for o in self.made for t in o.token_ids],
            logprobs=[v for o in self.made for v in o.logprobs],
            prompt_logprobs=first.prompt_logprobs,
            topk_ids=[x for o in self.made for x in (o.topk_ids or [])] if top else None,
            topk_logprobs=[x for o in self.made for x in (o.topk_logprobs or [])] if top else None,
            prompt_topk_ids=first.prompt_topk_ids,
            prompt_topk_logprobs=first.prompt_topk_logprobs,
            weight_versions=list(self.versions),
        )

    def advance(
        self, request_id: str, model: torch.nn.Module, processed: bool, shift: int = 0
    ) -> StepOutput:
        """One token; ``shift`` requests beside it move its logits in the last bits."""
        logits = model(input_ids=torch.tensor([self.sequence])).logits[0].float()
        logits = logits * (1 + 1e-6 * shift) if shift else logits
        prompt_logprobs = prompt_top = None
        if self.params.get("prompt_logprobs") is not None and self.generated == 0:
            scored = scored_row(
                logits[:-1].log_softmax(-1),
                torch.tensor(self.sequence[1:]),
                int(self.params["prompt_logprobs"]),
            )
            prompt_logprobs = scored.logprobs.tolist()
            prompt_top = (scored.topk_ids.tolist(), scored.topk_logprobs.tolist())
        choice = select_next_tokens(
            logits[-1:],
            [_row_sampling(self.params)],
            processed=processed,
            generators=[self.generator],
        )
        token = int(choice.tokens[0])
        self.sequence.append(token)
        self.generated += 1
        reason = None
        if token in self.params.get("stop_token_ids", []):
            reason = "stop"
        elif self.generated >= int(self.params["max_tokens"]):
            reason = "length"
        top = int(self.params.get("logprobs") or 0)
        return StepOutput(
            request_id,
            [token],
            [float(choice.logprobs[0])],
            reason,
            prompt_logprobs,
            choice.topk_ids.tolist() if top else None,
            choice.topk_logprobs.tolist() if top else None,
            *(prompt_top if prompt_top and prompt_top[0] and prompt_top[0][0] else (None, None)),
        )


def _row_sampling(params: dict[str, Any]) -> RowSampling:
    """The ``RowSampling`` behind a request's ``SamplingParams`` arguments."""
    top_k = params.get("top_k") or None
    return RowSampling(
        max_new_tokens=int(params["max_tokens"]),
        temperature=float(params.get("temperature", 1.0)),
        top_k=top_k if top_k and top_k > 0 else None,
        top_p=float(params.get("top_p", 1.0)),
        stop_token_ids=tuple(params.get("stop_token_ids", ())),
        stop_strings=(),
        seed=int(params.get("seed") or 0),
        min_p=float(params.get("min_p", 0.0)),
        top_logprobs=int(params.get("logprobs") or 0),
    )


def _placement_group_id() -> str:
    try:
        import ray

        group = ray.util.get_current_placement_group()
        return group.id.hex()[:8] if group is not None else "none"
    except Exception:
        return "none"
