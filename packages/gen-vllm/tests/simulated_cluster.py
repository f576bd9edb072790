"""Running a test's scenario on Ray's multi-node test cluster (``ray.cluster_utils.Cluster``), in
a process of its own.

The pytest process already holds a Ray connection of its own (the ``ray_session`` fixture), and a
process can hold only one, so a scenario that builds a simulated cluster runs as a script in a
subprocess, in a process group of its own. It gets its own Ray temp directory, so the address
file the cluster writes cannot lead another ``ray.init()`` on this machine into the simulated
cluster, and whatever it leaves running is killed with its group when it overruns.

In the test's process: ``scenario_report`` runs a test module as that script and returns the
report it wrote; ``assert_exited`` checks that the scenario's workers are gone. In the script's
process: ``run_as_scenario`` is its main, ``simulated_nodes`` its cluster, ``healing_fleet``
a fleet of fake engines on it, one per node, and ``busy_replica`` / ``remove_node_of`` pick a
replica holding rows and lose its node.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from processes import running

#: What ``ray._private.node.Node`` raises when a node does not register within 30 s.
NODE_START_TIMEOUT = "The current node timed out during startup"


def scenario_report(script: str, model_dir: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``script`` (a test module whose ``__main__`` calls ``run_as_scenario``) on the model
    in ``model_dir``, its events and report under ``work``; the report it wrote.

    A second try only when a node missed Ray's fixed 30 s start-up deadline, which a busy machine
    can make it miss; any other failure fails the test with the script's output. A run past
    ``timeout_s`` kills the whole process group (the script, its raylets and workers) and fails
    the test.
    """
    args = [str(model_dir), str(work / "events"), str(work / "report.json")]
    for attempt in (1, 2):
        returncode, log = _run_once(script, args, timeout_s)
        if returncode == 0 or attempt == 2 or NODE_START_TIMEOUT not in log:
            break
        print(f"simulated cluster: a node timed out during start-up; trying again\n{log[-3000:]}")
    assert returncode == 0, f"{Path(script).name}'s scenario failed:\n{log[-8000:]}"
    return json.loads((work / "report.json").read_text())


def run_as_scenario(scenario: Callable[[str, str], dict[str, Any]]) -> None:
    """A scenario script's main: ``scenario(model_dir, log_dir)``'s report, written where
    ``scenario_report`` reads it (the command line holds the three paths)."""
    _ship_fake_engine()
    model_dir, log_dir, out = sys.argv[1:4]
    Path(out).write_text(json.dumps(scenario(model_dir, log_dir)))


def _run_once(script: str, args: list[str], timeout_s: float) -> tuple[int, str]:
    ray_tmp = Path(tempfile.mkdtemp(prefix="rmn", dir="/tmp"))  # short: Unix socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_TMPDIR=str(ray_tmp),
        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
        # Idle workers prestarted per logical CPU only cost time on a small machine.
        RAY_enable_worker_prestart="0",
        RAY_prestart_worker_first_driver="0",
    )
    process = subprocess.Popen(
        [sys.executable, script, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # Ray's processes share the script's group
        log, _ = process.communicate()
        pytest.fail(f"simulated-cluster scenario ran past {timeout_s:g} s:\n{log[-6000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return process.returncode, log


def _ship_fake_engine() -> None:
    """In the scenario's process: send the fake engine's module to workers by value (they
    cannot import the tests' directory)."""
    import fake_vllm_engine
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(fake_vllm_engine)


@contextlib.contextmanager
def simulated_nodes(
    count: int, seen: dict[str, Any], *, head_cpus: int = 0, **node: Any
) -> Iterator[tuple[Any, list[Any]]]:
    """In the scenario's process: a ``Cluster`` of a head with ``head_cpus`` CPUs and no GPU
    and ``count`` worker nodes of ``node``'s resources (default one CPU each); yields it and
    its nodes (head first; a scenario may append nodes it adds). On exit Ray and the cluster
    stop, and ``seen["nodes_alive_after_shutdown"]`` says which nodes kept processes."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "num_gpus": 0, "include_dashboard": False},
    )
    nodes = [cluster.head_node]
    try:
        for _ in range(count):
            nodes.append(cluster.add_node(**(node or {"num_cpus": 1})))
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        seen["nodes_alive_after_shutdown"] = [n.any_processes_alive() for n in nodes]


def assert_exited(pids: list[int], within_s: float = 30.0) -> None:
    """In the test's process: every one of ``pids`` (a scenario's workers) exits within
    ``within_s`` (their raylet took them down)."""
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        time.sleep(0.5)
    assert not alive, f"worker processes {alive} outlived the simulated cluster"


def healing_fleet(
    cluster: Any, model_dir: str, log_dir: str, replicas: int, *, wedge_s: float, restarts: int
) -> tuple[Any, Any]:
    """In the scenario's process: a healing ``VllmGeneration`` of ``replicas`` fake engines
    on ``cluster``, one per node (one CPU each), keeping a copy of the committed weights;
    ``(placement, backend)``, both for the caller to shut down."""
    from fake_vllm_engine import FakeEngineFactory
    from gen_testkit.conformance import conformance_config
    from gen_vllm import RayVirtualCluster, VllmGeneration

    placement = RayVirtualCluster(
        [1] * replicas, use_gpus=False, num_cpus_per_bundle=1, address=cluster.address
    )
    config = conformance_config(
        backend="vllm",
        model_name=model_dir,
        vocab_size=512,
        max_new_tokens=64,
        stop_token_ids=[],
        vllm_cfg={
            "weight_deltas": True,
            "wedge_timeout_s": wedge_s,
            "max_replica_restarts": restarts,
        },
    )
    try:
        backend = VllmGeneration(placement, config, engine_factory=FakeEngineFactory(log_dir))
    except BaseException:
        placement.shutdown()
        raise
    return placement, backend


def busy_replica(backend: Any, call: threading.Thread, rng: random.Random) -> int | None:
    """A random replica whose engine holds rows of the running ``call``; None if the call
    ended first."""
    while call.is_alive():
        members = backend.replicas.member_ids()
        busy = [r for r, n in zip(members, backend.rows_in_flight()) if n]
        if busy:
            return rng.choice(busy)
        time.sleep(0.01)
    return None


def remove_node_of(cluster: Any, backend: Any, replica: int) -> str:
    """Lose ``replica``'s node: its raylet and every process on it stop. Returns its id."""
    node_id = backend.replicas.infos[replica]["node_id"]
    cluster.remove_node(next(node for node in cluster.worker_nodes if node.node_id == node_id))
    return node_id
