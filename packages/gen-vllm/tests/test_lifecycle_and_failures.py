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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
    assert _alive(pid)
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
    assert not _alive(pid)


def test_shutdown_stops_every_engine_process(own_backend, ray_session):
    pids = [info["pid"] for info in own_backend.replicas.infos]
    assert all(_alive(p) for p in pids)
    named_before = set(ray_session.util.list_named_actors())
    own_backend.shutdown()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    gone = named_before - set(ray_session.util.list_named_actors())
    assert len(gone) == len(pids)  # the backend's named actors are gone from Ray
    with pytest.raises(GenerationError, match="shut down"):
        own_backend.generate(pad_prompts([[5]], "right"), greedy=True)


def test_an_interrupted_generate_takes_its_rows_out_of_the_engines(own_backend):
    """Fails on the main before the shared base: Ctrl-C in a synchronous ``generate`` returned
    at once but left its rows running in the engines."""
    batch = pad_prompts([[5, 6, 7]] * 8, "right")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        own_backend.generate(batch, greedy=False)  # 8 rows of 200 tokens: seconds on 2 cores
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
