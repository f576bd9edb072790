"""Shared-memory segments never outlive their owner: a trainer that exits without closing its
refitter leaves none, and one killed mid-refit leaves none once the next process makes a segment.

The trainers are real processes refitting the testkit's n-gram backend (in their own process,
as gen-hf does) through ``Refitter``; segments are found in the shared-memory directory by the
pid in their names.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from gen_interface.weights.shm import (
    SEGMENT_PREFIX,
    create_segment,
    owner_of,
    owner_tag,
    segment_dir,
    sweep_orphans,
    unlink_segment,
)
from gen_testkit.conformance import conformance_config
from gen_testkit.ngram import NgramGeneration

TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from gen_interface.weights import Refitter
    from gen_testkit.conformance import conformance_config
    from gen_testkit.ngram import NgramGeneration

    config = conformance_config(backend="ngram", model_name="ngram", vocab_size=256)
    backend = NgramGeneration(dict(config, ngram={"vocab_size": 256, "order": 4}))
    weights = {k: torch.randn_like(v) for k, v in backend.state_dict().items()}
    refitter = Refitter(backend, bucket_bytes=2**20, hand_over=False)  # never closed
    refitter.refit(weights)
    print("refitted", flush=True)
    if sys.argv[1] == "hang":  # wait to be killed, segments held
        time.sleep(600)
    """
)


def _segments_of(pid: int) -> list[Path]:
    return [
        p for p in segment_dir().iterdir() if (owner := owner_of(p)) is not None and owner[1] == pid
    ]


def _trainer(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, mode], stdout=subprocess.PIPE, text=True
    )


def test_a_trainer_that_exits_without_closing_its_refitter_leaves_no_segment():
    trainer = _trainer("exit")
    out, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0 and "refitted" in out
    assert _segments_of(trainer.pid) == []


def test_a_trainer_killed_mid_refit_leaves_no_segment_once_another_process_makes_one():
    trainer = _trainer("hang")
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "refitted"
        held = _segments_of(trainer.pid)
        assert len(held) == 2, f"the refitter's two buckets, not {held}"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        assert all(p.exists() for p in held), "nothing removed them yet: the owner died unheard"
    finally:
        trainer.kill()
        trainer.wait(30)
    # The next process to make a segment (a trainer's refit, a backend's staging) sweeps once.
    make_one = (
        "from gen_interface.weights.shm import create_segment, unlink_segment; "
        "unlink_segment(create_segment(1)[0])"
    )
    subprocess.run([sys.executable, "-c", make_one], check=True, timeout=120)
    assert _segments_of(trainer.pid) == []


def test_starting_a_backend_sweeps_nothing():
    """A constructor changes nothing beyond its object: only making a segment sweeps."""
    namespace = owner_tag().split("-")[0]
    orphan = (
        segment_dir() / f"{SEGMENT_PREFIX}{namespace}-{_a_pid_not_running()}-1-{uuid.uuid4().hex}"
    )
    orphan.write_bytes(b"x")
    try:
        config = conformance_config(backend="ngram", model_name="ngram", vocab_size=64)
        NgramGeneration(dict(config, ngram={"vocab_size": 64, "order": 2})).shutdown()
        assert orphan.exists()
        assert str(orphan) in sweep_orphans(), "the orphan is one a sweep removes"
    finally:
        orphan.unlink(missing_ok=True)


def test_the_sweep_removes_only_segments_whose_owner_is_gone(tmp_path):
    dead_pid = _a_pid_not_running()
    mine = owner_of(create_segment(1)[0])
    assert mine is not None and mine[1] == os.getpid()
    namespace, pid, start = mine[0], mine[1], mine[2] or 0

    def name(ns: object, pid: int, start: int) -> str:
        return f"{SEGMENT_PREFIX}{ns}-{pid}-{start}-{uuid.uuid4().hex}"

    names = {
        "dead": name(namespace, dead_pid, 123),
        "dead_old_format": f"{SEGMENT_PREFIX}{dead_pid}-{uuid.uuid4().hex}",
        # this process's pid, another start time: a process that had the pid before
        "reused_pid": name(namespace, pid, start + 1),
        "mine": name(namespace, pid, start),
        "mine_old_format": f"{SEGMENT_PREFIX}{pid}-{uuid.uuid4().hex}",
        # a dead pid here, but made in another PID namespace (another container)
        "other_namespace": name((namespace or 0) + 1, dead_pid, 123),
        "not_ours": f"something-{dead_pid}-123-{uuid.uuid4().hex}",
    }
    for entry in names.values():
        (tmp_path / entry).write_bytes(b"x")
    removed = {Path(p).name for p in sweep_orphans(tmp_path)}
    assert removed == {names["dead"], names["dead_old_format"], names["reused_pid"]}
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {
        names["mine"],
        names["mine_old_format"],
        names["other_namespace"],
        names["not_ours"],
    }


def test_the_sweep_takes_another_prefix_and_removes_directories(tmp_path):
    """Another package's owned files and directories (gen-sglang's staged checkpoints): named
    with its own prefix and ``owner_tag``, swept the same way, directories whole."""
    dead = owner_tag().split("-")
    dead[1] = str(_a_pid_not_running())
    gone = tmp_path / f"pkg-{'-'.join(dead)}-abc_1"
    (gone / "weights").mkdir(parents=True)
    (gone / "weights" / "model.safetensors").write_bytes(b"x")
    alive = tmp_path / f"pkg-{owner_tag()}-def_2"
    alive.mkdir()
    other_prefix = tmp_path / f"{SEGMENT_PREFIX}{'-'.join(dead)}-0"
    other_prefix.write_bytes(b"x")
    assert sweep_orphans(tmp_path, "pkg-") == [str(gone)]
    assert not gone.exists() and alive.exists() and other_prefix.exists()


@pytest.fixture(autouse=True)
def _no_segment_of_this_process_left():
    before = set(_segments_of(os.getpid()))
    yield
    for path in set(_segments_of(os.getpid())) - before:
        unlink_segment(str(path))


def _a_pid_not_running() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return child.pid
