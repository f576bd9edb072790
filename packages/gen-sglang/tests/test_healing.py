"""A fleet that heals, on real SGLang servers (2 on the CPU): after a refit (so the weights are
in no checkpoint on disk), one server's session is SIGKILLed while it streams a call's rows.
The call returns what the fault-free call returned (the testkit's near-tie rule: the moved rows
run in another batch, and SGLang's CPU kernels are not batch-invariant), at the refit's
version; the fleet gets back to full size with a replacement that loaded the staged copy and
verified its checksum against the survivor's; the metrics show the loss and the restart; and
the shutdown leaves no process of any server, the replacement's included. The state logic
itself is checked on stand-ins in ``test_fleet.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Generator
from typing import Any

import torch
from gen_backend_kit.fleet_health import ReplicaState
from gen_interface.weights import refit
from gen_sglang import SglangGeneration
from gen_sglang.server import session_processes
from gen_testkit.compare import compare_generations
from gen_testkit.conformance import conformance_config
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from gen_testkit.tolerances import tolerance_for

PROMPTS = [[5 + i, 17, 42 + 3 * i, 8] for i in range(8)]
#: What ``FleetClient.chunks`` gives (the tests wrap it).
Chunks = Generator[dict[str, Any], None, None]
SETTLE_S = 300  # a replacement server's start on two busy cores


def _moved(tiny: TinyModel, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.2 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in tiny.state_dict().items()
    }


def _versions(output: Any) -> set[int]:
    return set(output["weight_versions"][:, len(PROMPTS[0]) :].flatten().tolist())


def test_a_server_killed_mid_call_costs_a_re_run_and_the_fleet_heals(tiny_qwen2: TinyModel):
    config = conformance_config(
        backend="sglang",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        max_new_tokens=64,
        stop_token_ids=[],
        sglang_cfg={"num_replicas": 2, "radix_cache": False},
    )
    backend = SglangGeneration(config)
    sessions = [server.process.pid for server in backend._servers]
    try:
        tolerance = tolerance_for("float32", across_backends=False)
        version = refit(backend, _moved(tiny_qwen2, 1))
        batch = pad_prompts(PROMPTS, "left")
        backend.generate(batch, greedy=True)  # warm
        started = time.monotonic()
        reference = backend.generate(batch, greedy=True)
        clean_s = time.monotonic() - started
        assert _versions(reference) == {version}

        victim = backend._servers[1]
        streaming = threading.Event()
        chunks = backend._client.chunks

        def watched(server: Any, body: dict[str, Any]) -> Chunks:
            for chunk in chunks(server, body):
                if server is victim:
                    streaming.set()
                yield chunk

        backend._client.chunks = watched  # type: ignore[method-assign]
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.update(result=backend.generate(batch, True)))
        thread.start()
        assert streaming.wait(60), "the call never reached replica 1"
        os.killpg(victim.process.pid, signal.SIGKILL)
        lost_at = time.monotonic()
        thread.join(timeout=120)
        assert "result" in out, "the call did not return"
        call_s = time.monotonic() - lost_at
        vars(backend._client).pop("chunks")

        compare_generations(
            reference,
            out["result"],
            logprob_atol=tolerance.logprob_atol,
            near_tie=tolerance.near_tie,
        ).assert_ok("the call with replica 1 SIGKILLed")
        assert _versions(out["result"]) == {version}
        metrics = backend.get_logger_metrics()
        assert metrics["fleet_faults_total"] == 1 and metrics["fleet_rows_rerun_total"] >= 1
        assert metrics["fleet_rows_lost_total"] == 0

        assert backend._fleet_().wait_settled(SETTLE_S), "the replacement was not admitted"
        healed_s = time.monotonic() - lost_at
        replacement = backend._servers[1]
        assert replacement is not victim
        sessions.append(replacement.process.pid)
        metrics = backend.get_logger_metrics()
        assert metrics["fleet_replicas_serving"] == 2 and metrics["fleet_size"] == 2
        assert metrics["replica_1_state"] == ReplicaState.SERVING
        assert metrics["fleet_restarts_total"] == 1 and metrics["fleet_epoch"] == 2
        assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == version
        # the replacement serves the refit's weights (the staged copy), not the checkpoint's
        again = backend.generate(batch, greedy=True)
        compare_generations(
            reference, again, logprob_atol=tolerance.logprob_atol, near_tie=tolerance.near_tie
        ).assert_ok("after healing")
        assert _versions(again) == {version}
        print(
            f"\nSIGKILL: the call returned {call_s:.1f} s after the kill (a fault-free call: "
            f"{clean_s:.1f} s), "
            f"{metrics['fleet_rows_rerun_total']} rows re-run; full fleet {healed_s:.1f} s "
            f"after the loss (heal {metrics['fleet_heal_seconds_last']:.1f} s)"
        )
    finally:
        backend.shutdown()
    for pgid in sessions:
        assert session_processes(pgid) == [], f"session {pgid} outlived the shutdown"
