"""``VllmGenerationWorker``: one vLLM engine in its own process, run as a Ray actor.

Everything crossing the actor boundary is plain data: token-id lists, small dicts of sampling
settings, weight handles. The engine runs in the actor's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``collective_rpc`` reaches the worker extension
without another hop.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from typing import Any

from gen_interface import GenerationError

__all__ = ["EXTENSION_CLASS", "RowOutput", "VllmGenerationWorker"]

EXTENSION_CLASS = "gen_vllm.extension.UpdatableVllmInternalWorker"

#: One generated row: (token ids, their logprobs, vLLM's finish reason: "stop" or "length").
RowOutput = tuple[list[int], list[float], str]


class VllmGenerationWorker:
    """Owns one vLLM engine. Built by ``VllmGeneration``, one per data-parallel replica.

    Args:
        model: model directory or hub name.
        engine_args: keyword arguments for ``vllm.LLM``.
        cpu_slot: ``(slot, slots)``: take the slot-th of ``slots`` equal shares of this
            machine's cores (CPU engines sharing a machine), or None to leave affinity alone.
        env: environment variables to set before vLLM is imported.
    """

    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        cpu_slot: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
    ):
        os.environ.update(env or {})
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _allow_amx()
        _undo_worker_niceness()
        cpu_ids = _cores_for(cpu_slot) if cpu_slot else None
        if cpu_ids:
            os.sched_setaffinity(0, cpu_ids)
            os.environ["OMP_NUM_THREADS"] = str(len(cpu_ids))
            import torch

            torch.set_num_threads(len(cpu_ids))
        start = time.perf_counter()
        from vllm import LLM

        self.llm = LLM(model=model, worker_extension_cls=EXTENSION_CLASS, **engine_args)
        self.startup_seconds = time.perf_counter() - start

    def info(self) -> dict[str, Any]:
        """Where this replica runs and what its engine can take."""
        model_config = self.llm.llm_engine.model_config
        specs, optional = self.llm.collective_rpc("checkpoint_specs")[0]
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device_ids": self.llm.collective_rpc("report_device_id"),
            "vocab_size": model_config.get_vocab_size(),
            "max_model_len": model_config.max_model_len,
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "startup_seconds": self.startup_seconds,
            "checkpoint_specs": specs,
            "optional_weights": optional,
        }

    def generate(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[RowOutput]:
        """Generate one completion per prompt with its own sampling settings.

        Args:
            prompts: token ids of each prompt.
            params: ``vllm.SamplingParams`` keyword arguments, one dict per prompt.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [SamplingParams(**p) for p in params],
            use_tqdm=False,
        )
        rows: list[RowOutput] = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [
                float(_at(position, token))
                for position, token in zip(completion.logprobs or [], tokens)
            ]
            rows.append((tokens, logprobs, completion.finish_reason or "length"))
        return rows

    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """Teacher-forced raw logprobs of each sequence's tokens after its prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False
        )
        rows = []
        for output, sequence, start in zip(outputs, sequences, prompt_lengths):
            positions = output.prompt_logprobs or []
            rows.append([_at(positions[t], sequence[t]) for t in range(start, len(sequence))])
        return rows

    def update_weights_from_ipc_handles(self, handles: dict[str, Any]) -> list[dict[str, Any]]:
        """Load new weights in every worker of this engine, then drop KV computed with the old."""
        reports = self.llm.collective_rpc("update_weights_from_ipc_handles", args=(handles,))
        self.llm.reset_prefix_cache()
        return reports

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        """Stop the engine and free its memory; the actor is killed afterwards."""
        engine = getattr(self, "llm", None)
        if engine is not None:
            del self.llm
            del engine
            gc.collect()


def _at(position: Any, token: int) -> float:
    """The logprob vLLM reports for ``token`` at one position (it always includes that token)."""
    if position is None or token not in position:
        raise GenerationError(f"vLLM returned no logprob for token {token}")
    return float(position[token].logprob)


def _cores_for(slot: tuple[int, int]) -> list[int]:
    """The slot-th of ``slots`` equal, disjoint shares of the cores this process may use."""
    index, count = slot
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // count)
    chosen = cores[index * share : (index + 1) * share]
    return chosen or [cores[index % len(cores)]]


def _allow_amx() -> None:
    """Ask Linux for permission to use AMX tile registers in this process.

    vLLM's CPU attention kernels use AMX for bfloat16 on CPUs that report it, but never ask the
    kernel for the AMX state; where nothing else in the process has asked, the first bfloat16
    attention call dies with SIGILL. Asking is harmless where AMX is absent.
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    with contextlib.suppress(OSError):
        ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata)


def _undo_worker_niceness() -> None:
    """Run at normal priority where allowed.

    Ray starts workers at niceness 15, fit for background tasks; an engine at that priority loses
    5-10% of its throughput to any other process on its cores (measured on 2 cores). Lowering
    niceness needs privilege, so this is best effort; ``RayVirtualCluster`` also starts its own
    Ray with ``RAY_worker_niceness=0``.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)
