"""What a healing fleet's fault costs: a call that loses a replica mid-way against the same call
without the fault, and the time until the fleet is full again.

    .venv/bin/python tools/bench/healing.py [--model tiny-qwen2] [--rows 16] [--new 64]
        [--reps 3] [--faults kill,stop] [--wedge-timeout 8] [--json FILE]

Real gen-vllm engines on the CPU: 2 replicas (one bundle of one CPU each), ``weight_deltas``
on, after one refit, so that a replacement must take the fleet's weights from a peer's copy
(not the checkpoint). Per repetition and fault, interleaved: the fault-free call (``--rows``
prompts of 4 ids, ``--new`` greedy tokens each, no stop token), then the same call with one
replica's worker hit once it holds rows: ``kill`` (SIGKILL: its output stream ends) or ``stop``
(SIGSTOP: a wedge, noticed after ``--wedge-timeout`` seconds without a message). The replica
hit alternates between repetitions; the fleet is full again, and the replacement warmed by an
untimed call (a fresh engine's first call costs seconds more), before the next timed call.

Per fault, the median with the spread (min-max) over repetitions of:

- the call's extra wall time: the faulty call minus the fault-free call of its repetition;
- the time from the signal to a full fleet again (polled ``fleet_replicas_serving``), and
  gen-vllm's own ``fleet_heal_seconds_last`` (from the loss noticed to the admission);
- rows re-run (``fleet_rows_rerun_total``'s growth over the call);
- whether the faulty call equals the fault-free call: rows bit for bit, and every row within
  the testkit's near-tie rule (a re-run row lands in another batch, and vLLM's CPU build is not
  batch-invariant, so a re-run row may take the other side of a near tie).

Each replacement starts a real engine (about 20 s on two idle cores); run on an otherwise idle
machine, or say that it was not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch
from gen_interface import NoReplicaServingError
from gen_interface.weights import refit
from gen_testkit.compare import compare_generations
from gen_testkit.models import build_tiny_model
from gen_testkit.tolerances import tolerance_for
from workloads import left_padded, sampled_config

REPLICAS = 2
HEAL_LIMIT_S = 600.0  # a fleet not full again by then: the run stops with an error
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
SPURIOUS_TRIES = 3  # fault-free calls that may lose a replica all the same before giving up


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen2", help="testkit preset")
    parser.add_argument("--rows", type=int, default=16, help="rows per call")
    parser.add_argument("--new", type=int, default=64, help="greedy tokens per row")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (each: every fault)")
    parser.add_argument("--faults", default="kill,stop", help="of: kill, stop")
    parser.add_argument(
        "--wedge-timeout", type=float, default=8.0, help="vllm_cfg.wedge_timeout_s (seconds)"
    )
    parser.add_argument("--json", help="write every repetition's figures here")
    args = parser.parse_args()
    unknown = set(args.faults.split(",")) - set(SIGNALS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {sorted(SIGNALS)}")
    return args


@dataclass
class Figure:
    """One fault's repetitions."""

    fault: str
    clean_seconds: list[float] = field(default_factory=list)
    faulty_seconds: list[float] = field(default_factory=list)
    full_again_seconds: list[float] = field(default_factory=list)
    heal_seconds: list[float] = field(default_factory=list)
    rows_rerun: list[int] = field(default_factory=list)
    rows_bit_equal: list[int] = field(default_factory=list)
    near_tie_ok: list[bool] = field(default_factory=list)

    def extra_seconds(self) -> list[float]:
        return [f - c for f, c in zip(self.faulty_seconds, self.clean_seconds)]

    def row(self, rows: int) -> str:
        equal = f"{min(self.rows_bit_equal)}-{max(self.rows_bit_equal)} of {rows}"
        return (
            f"| {self.fault} | {_spread(self.clean_seconds)} | {_spread(self.faulty_seconds)} "
            f"| {_spread(self.extra_seconds())} | {_spread(self.full_again_seconds)} "
            f"| {_spread(self.heal_seconds)} | {_spread(self.rows_rerun, '.0f')} | {equal} "
            f"| {'yes' if all(self.near_tie_ok) else 'NO'} |"
        )


def _spread(values: list[float] | list[int], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _moved(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights moved by a fifth of each tensor's spread: a trainer's step."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.2 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in state.items()
    }


class Fleet:
    """``VllmGeneration`` with ``REPLICAS`` healing replicas, after one refit."""

    def __init__(self, model: Any, new: int, wedge_timeout_s: float):
        from gen_vllm import RayVirtualCluster, VllmGeneration

        self.cluster = RayVirtualCluster([REPLICAS], use_gpus=False, num_cpus_per_bundle=1)
        try:
            self.backend = VllmGeneration(
                self.cluster,
                sampled_config(
                    "vllm",
                    str(model.path),
                    new,
                    colocated={"enabled": False},
                    vllm_cfg={
                        "cpu_kv_cache_gib": 0.25,
                        "weight_deltas": True,
                        "wedge_timeout_s": wedge_timeout_s,
                    },
                ),
                "heal-bench",
            )
        except BaseException:
            self.cluster.shutdown()
            raise
        self.version = refit(self.backend, _moved(model.state_dict(), 1))
        self.spurious = 0  # replicas lost in calls with no fault sent

    def metrics(self) -> dict[str, Any]:
        return self.backend.get_logger_metrics()

    def clean(self, batch: Any) -> tuple[dict[str, Any], float]:
        """The call with no fault sent: its output and wall time. A replica lost meanwhile
        all the same (on a busy machine a slow step can pass the wedge bound) is counted in
        ``spurious``; the fleet is healed and the call made again, at most ``SPURIOUS_TRIES``
        times."""
        for _ in range(SPURIOUS_TRIES):
            before = self.metrics()["fleet_faults_total"]
            start = time.perf_counter()
            try:
                output = self.backend.generate(batch, greedy=True)
            except NoReplicaServingError:
                output = None
            seconds = time.perf_counter() - start
            if self.metrics()["fleet_faults_total"] == before and output is not None:
                return output, seconds
            self.spurious += 1
            print("a replica was lost in a call with no fault sent: healing, then again")
            self.wait_full(before)
        raise RuntimeError(
            f"{SPURIOUS_TRIES} calls with no fault sent lost a replica: the machine is too "
            "busy for this wedge bound; raise --wedge-timeout"
        )

    def faulty(self, batch: Any, replica: int, sig: signal.Signals) -> tuple[Any, float, float]:
        """The call with ``replica``'s worker sent ``sig`` once it holds rows: the output, the
        call's wall time, and ``time.perf_counter()`` at the signal."""
        out: dict[str, Any] = {}
        pid = self.backend.replicas.infos[replica]["pid"]

        def call() -> None:
            try:
                out["output"] = self.backend.generate(batch, greedy=True)
            except BaseException as exc:
                out["error"] = exc

        thread = threading.Thread(target=call)
        start = time.perf_counter()
        thread.start()
        signalled = None
        while thread.is_alive() and signalled is None:
            counts = dict(zip(self.backend.replicas.member_ids(), self.backend.rows_in_flight()))
            if counts.get(replica):
                os.kill(pid, sig)
                signalled = time.perf_counter()
            time.sleep(0.005)
        thread.join()
        seconds = time.perf_counter() - start
        if "error" in out:
            raise RuntimeError(f"the call with replica {replica} hit failed") from out["error"]
        if signalled is None:
            raise RuntimeError(
                f"the call ended before replica {replica} held rows: raise --rows or --new"
            )
        return out["output"], seconds, signalled

    def wait_full(self, faults_before: int) -> None:
        """Until the fault was noticed and every replica serves again."""
        deadline = time.monotonic() + HEAL_LIMIT_S
        while True:
            metrics = self.metrics()
            noticed = metrics["fleet_faults_total"] > faults_before
            if noticed and metrics["fleet_replicas_serving"] == REPLICAS and self.settled():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet was not full {HEAL_LIMIT_S:.0f} s after the fault")
            time.sleep(0.05)

    def settled(self) -> bool:
        fleet = self.backend.fleet
        return fleet is not None and fleet.settled()

    def close(self) -> None:
        """Shut the fleet down (a lost worker, stopped or not, was killed by the fleet)."""
        try:
            self.backend.shutdown()
        finally:
            self.cluster.shutdown()


def measure(args: argparse.Namespace) -> tuple[list[Figure], int]:
    """Every fault's figures, and the replicas lost in calls with no fault sent."""
    model = build_tiny_model(args.model)
    prompts = [[5 + i, 17, 42 + 3 * i, 8] for i in range(args.rows)]
    batch = left_padded(prompts)
    tolerance = tolerance_for("float32", across_backends=False)
    faults = args.faults.split(",")
    figures = {fault: Figure(fault) for fault in faults}
    print(f"{args.model}: starting {REPLICAS} engines and refitting", flush=True)
    fleet = Fleet(model, args.new, args.wedge_timeout)
    try:
        fleet.clean(batch)  # warm: an engine's first call costs seconds more
        for rep in range(args.reps):
            for number, fault in enumerate(faults):
                reference, clean_s = fleet.clean(batch)
                before = fleet.metrics()
                replica = (rep + number) % REPLICAS
                output, faulty_s, signalled = fleet.faulty(batch, replica, SIGNALS[fault])
                fleet.wait_full(before["fleet_faults_total"])
                full_s = time.perf_counter() - signalled
                after = fleet.metrics()
                fleet.clean(batch)  # warm the replacement: its first call costs seconds more
                report = compare_generations(
                    reference,
                    output,
                    logprob_atol=tolerance.logprob_atol,
                    near_tie=tolerance.near_tie,
                )
                figure = figures[fault]
                figure.clean_seconds.append(clean_s)
                figure.faulty_seconds.append(faulty_s)
                figure.full_again_seconds.append(full_s)
                figure.heal_seconds.append(after["fleet_heal_seconds_last"])
                figure.rows_rerun.append(
                    after["fleet_rows_rerun_total"] - before["fleet_rows_rerun_total"]
                )
                figure.rows_bit_equal.append(_bit_equal_rows(reference, output))
                figure.near_tie_ok.append(report.ok)
                versions = set(output["weight_versions"][:, len(prompts[0]) :].flatten().tolist())
                if versions != {fleet.version}:
                    raise RuntimeError(f"rows carry weight versions {versions}, not the fleet's")
                print(
                    f"rep {rep} {fault} replica {replica}: call {faulty_s:.2f} s "
                    f"(fault-free {clean_s:.2f} s), full again {full_s:.1f} s, "
                    f"{figure.rows_rerun[-1]} rows re-run, "
                    f"{figure.rows_bit_equal[-1]}/{args.rows} rows bit-equal",
                    flush=True,
                )
    finally:
        fleet.close()
    return list(figures.values()), fleet.spurious


def _bit_equal_rows(a: dict[str, Any], b: dict[str, Any]) -> int:
    same = (a["output_ids"] == b["output_ids"]).all(dim=1) & (a["logprobs"] == b["logprobs"]).all(
        dim=1
    )
    return int(same.sum())


def main() -> list[Figure]:
    args = parse_args()
    figures, spurious = measure(args)
    print(
        f"\n{args.rows} rows x {args.new} greedy tokens, {REPLICAS} replicas, {args.reps} reps, "
        f"wedge_timeout_s {args.wedge_timeout}; median (min-max)\n"
    )
    if spurious:
        print(
            f"replicas lost in calls with no fault sent (healed, the call made again): {spurious}"
        )
    print(
        "| fault | fault-free call s | faulty call s | extra s | signal to full fleet s "
        "| heal s (fleet metric) | rows re-run | rows bit-equal | all rows within near-tie |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for figure in figures:
        print(figure.row(args.rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"figures": [asdict(f) for f in figures], "spurious_losses": spurious},
                out,
                indent=1,
            )
    return figures


if __name__ == "__main__":
    main()
