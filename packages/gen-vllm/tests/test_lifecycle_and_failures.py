"""Start-up, shutdown and a worker dying: errors come quickly and nothing is left behind."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from gen_interface import BackendUnavailableError, GenerationError
from gen_testkit.conformance import conformance_config
from gen_testkit.strategies import pad_prompts
from interrupts import ctrl_c_while_waiting_in
from processes import running


@pytest.fixture
def own_backend(request, ray_session, tiny_qwen2):
    """A backend of its own: these tests kill it. ``vllm_cfg`` extras come as the fixture's
    param."""
    from gen_vllm import RayVirtualCluster, VllmGeneration

    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    config = conformance_config(
        backend="vllm",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        max_new_tokens=200,
        stop_token_ids=[],
        vllm_cfg={"cpu_kv_cache_gib": 0.25, **getattr(request, "param", {})},
    )
    backend = VllmGeneration(cluster, config)
    yield backend
    backend.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("own_backend", [{"healing": False}], indirect=True)  # fail-stop, chosen
def test_a_dead_worker_fails_generate_within_seconds_and_shutdown_leaves_nothing(own_backend):
    pid = own_backend.replicas.infos[0]["pid"]
    assert running(pid)
    batch = pad_prompts([[5, 6, 7]] * 64, "right")
    outcome: dict = {}

    def run():
        try:
            own_backend.generate(batch, greedy=False)
        except GenerationError as exc:
            outcome["error"] = exc
            outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate hung after its worker died"
    assert "died" in str(outcome["error"])
    assert outcome["at"] - killed_at < 15
    with pytest.raises(GenerationError, match="died"):
        own_backend.generate(pad_prompts([[5]], "right"), greedy=True)
    own_backend.shutdown()
    own_backend.shutdown()  # idempotent
    assert not running(pid)


def test_shutdown_stops_every_engine_process(own_backend, ray_session):
    pids = [info["pid"] for info in own_backend.replicas.infos]
    assert all(running(p) for p in pids)
    named_before = set(ray_session.util.list_named_actors())
    own_backend.shutdown()
    deadline = time.monotonic() + 30
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(p) for p in pids)
    gone = named_before - set(ray_session.util.list_named_actors())
    assert len(gone) == len(pids)  # the backend's named actors are gone from Ray
    with pytest.raises(GenerationError, match="shut down"):
        own_backend.generate(pad_prompts([[5]], "right"), greedy=True)


def test_an_interrupted_generate_takes_its_rows_out_of_the_engines(own_backend):
    """Fails on the main before the shared base: Ctrl-C in a synchronous ``generate`` returned
    at once but left its rows running in the engines. The Ctrl-C comes once ``generate`` waits
    for its rows, with Python's handler in place (``interrupts.py``): a timer's fixed delay
    made this depend on the machine's load and on the SIGINT disposition pytest inherited.
    It comes once the rows are in the engine, so that there is something to take out."""
    from gen_vllm.background_loop import BackgroundLoop

    batch = pad_prompts([[5, 6, 7]] * 8, "right")

    def rows_running() -> bool:
        return sum(own_backend.rows_in_flight()) > 0

    with (
        ctrl_c_while_waiting_in(BackgroundLoop.run, rows_running) as sent,
        pytest.raises(KeyboardInterrupt),
    ):
        own_backend.generate(batch, greedy=False)  # 8 rows of 200 tokens: seconds here
    assert sent.is_set()
    deadline = time.monotonic() + 10
    while own_backend.rows_in_flight() != [0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert own_backend.rows_in_flight() == [0]
    assert own_backend.with_sampling(max_new_tokens=2).generate(batch, greedy=True).size == 8


def test_a_start_vllm_refuses_reports_vllm_s_whole_reason(ray_session, tiny_qwen2):
    """Fails on the main before the shared base: the reason was cut out of the message ("...")
    and only the workers' log held it."""
    from gen_vllm import RayVirtualCluster, VllmGeneration

    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    config = conformance_config(
        backend="vllm",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        vllm_cfg={"max_model_len": 100_000, "cpu_kv_cache_gib": 0.25},
    )
    try:
        with pytest.raises(
            BackendUnavailableError,
            match=r"(?s)failed to start: .*max_model_len \(100000\) is greater",
        ):
            VllmGeneration(cluster, config)
    finally:
        cluster.shutdown()


_LOOPBACK_CHECK = """
import os, psutil
from gen_vllm import RayVirtualCluster

cluster = RayVirtualCluster([1], use_gpus=False)
# this driver, and the GCS, raylet and workers its Ray started
mine = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
listening = {
    (c.laddr.ip, psutil.Process(c.pid).name())
    for c in psutil.net_connections("tcp")
    if c.status == psutil.CONN_LISTEN and c.pid in mine
}
cluster.shutdown()
print(sorted(listening))
assert listening, "no Ray process was seen listening"
outside = sorted(x for x in listening if x[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"))
assert not outside, f"listening beyond loopback: {outside}"
"""


def test_a_ray_the_backend_starts_for_itself_listens_on_loopback_only():
    """Fails on the main before the shared base: the GCS, the raylet and the driver of a private
    Ray listened on every interface. Run in a process of its own: the session's Ray is joined,
    not started."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", _LOOPBACK_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_an_engine_that_cannot_start_is_reported(ray_session, tmp_path):
    from gen_vllm import RayVirtualCluster, VllmGeneration

    (tmp_path / "config.json").write_text("{}")
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    config = {
        "backend": "vllm",
        "model_name": str(tmp_path),
        "max_new_tokens": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "pad_token_id": 0,
        "stop_token_ids": [],
    }
    try:
        with pytest.raises(BackendUnavailableError, match="failed to start"):
            VllmGeneration(cluster, config)
    finally:
        cluster.shutdown()


_TOO_MANY_REPLICAS = """
import json, sys, time, psutil, ray
from gen_interface import BackendUnavailableError
from gen_vllm import RayVirtualCluster, VllmGeneration

config = {
    "backend": "vllm", "model_name": "never-loaded", "max_new_tokens": 4, "temperature": 1.0,
    "top_p": 1.0, "pad_token_id": 0, "stop_token_ids": [],
}
began = time.monotonic()
try:
    VllmGeneration.create(config, replicas=3, use_gpus=False)
except BaseException as exc:
    refused = {"type": type(exc).__name__, "message": str(exc),
               "is_unavailable": isinstance(exc, BackendUnavailableError)}
else:
    refused = None
seconds = time.monotonic() - began
stopped = not ray.is_initialized()
# Ray is usable again: a cluster that fits starts a fresh Ray of its own and reserves its bundles.
with RayVirtualCluster([2], use_gpus=False) as cluster:
    fitted = cluster.world_size
time.sleep(1)
left = [p.name() for p in psutil.Process().children(recursive=True) if p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE]
print(json.dumps({"refused": refused, "seconds": seconds, "stopped": stopped, "fitted": fitted,
                  "left": left}))
"""


def test_more_replicas_than_the_backends_own_ray_can_place_are_refused_at_once():
    """Three replicas of one CPU on a Ray of 2 logical CPUs (the backend's own Ray, on this 2-core
    machine by default): before, the placement group waited 3 minutes for CPUs that can never
    appear, and the error path then asked the Ray it had just stopped for its nodes (an untyped
    RaySystemError). Now the typed error names what was asked and what exists, in seconds, and
    Ray is stopped and startable again. A process of its own: the session's Ray is joined, not
    started."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": 2})  # whatever this machine's cores
    done = subprocess.run(
        [sys.executable, "-c", _TOO_MANY_REPLICAS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    refused = seen["refused"]
    assert refused is not None, "3 replicas on 2 CPUs were accepted"
    assert refused["is_unavailable"], refused
    assert "[3] bundles of 1 CPUs each" in refused["message"], refused["message"]
    assert "2 CPUs" in refused["message"] and "fixed-size" in refused["message"]
    # The default placement timeout is 180 s; Ray's own start takes a few seconds here.
    assert seen["seconds"] < 60, seen
    assert seen["stopped"], "the refused backend's own Ray is still running"
    assert seen["fitted"] == 2
    assert seen["left"] == [], f"processes left behind: {seen['left']}"
