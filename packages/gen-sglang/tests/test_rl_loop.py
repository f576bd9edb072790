"""``examples/reinforce_loop.py`` on SGLang and on gen-hf: refit every step, the same seeds.

Sampled at temperature 1 with each row's own seed, the two give the same rewards and weight
versions step for step, and logprob mismatches equal to float32 noise: SGLang's rows are sampled
inside the server by the decoding step gen-hf runs, from generators seeded the same way, and
every refit reached SGLang whole (a missing or stale weight changes the tokens within a step or
two). The loop's ``shutdown`` leaves no server process or staged file behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from example_modules import load_example
from gen_interface.weights.shm import owner_tag, segment_dir
from gen_sglang.checkpoint import STAGED_PREFIX
from gen_testkit.models import TinyModel


def _servers_and_staging() -> tuple[set[int], set[str]]:
    """This process's SGLang server processes running: the sessions of the processes whose
    environment has the ``TMPDIR`` named with this process's owner tag (SGLang retitles some of
    its processes over their environment, hence the sessions); this process's staged
    checkpoints and servers' temp directories. Other SGLang servers on the machine (other
    test runs) come and go meanwhile: they are not counted. Whether a server leaves files in
    ``/dev/shm`` is checked by ``test_faults``, which can tell a server's own files apart."""
    mine = f"TMPDIR={segment_dir() / STAGED_PREFIX}{owner_tag()}-".encode()
    sessions: dict[int, int] = {}
    marked = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                sessions[int(entry.name)] = os.getsid(int(entry.name))
                environment = (entry / "environ").read_bytes()
            except OSError:
                continue
            if any(v.startswith(mine) for v in environment.split(b"\0")):
                marked.add(sessions[int(entry.name)])
    servers = {pid for pid, sid in sessions.items() if sid in marked}
    staged = {p.name for p in segment_dir().glob(f"{STAGED_PREFIX}{owner_tag()}-*")}
    return servers, staged


def test_the_loop_gives_the_same_rewards_on_sglang_as_on_hf(tiny_qwen2: TinyModel):
    example = load_example("reinforce_loop")
    model = str(tiny_qwen2.path)
    on_hf = example.run(model, steps=3, seed=5, lr=0.5)
    before = _servers_and_staging()
    on_sglang = example.run(model, steps=3, seed=5, lr=0.5, backend="sglang")
    assert _servers_and_staging() == before, "shutdown left a server process or its files"
    assert [s.reward for s in on_sglang] == [s.reward for s in on_hf]
    assert [s.weight_version for s in on_sglang] == [1, 2, 3]
    assert [s.weight_version for s in on_hf] == [1, 2, 3]
    for mine, theirs in zip(on_sglang, on_hf):
        assert abs(mine.mismatch - theirs.mismatch) < 2e-5
        assert mine.mismatch < 2e-5  # SGLang's logprobs are the trainer's, to float32 noise
    assert len({s.reward for s in on_hf}) > 1  # the policy moved: the steps differ
