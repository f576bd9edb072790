"""``examples/reinforce_loop.py`` on SGLang and on gen-hf: refit every step, the same seeds.

Sampled at temperature 1 with each row's own seed, the two give the same rewards and weight
versions step for step, and logprob mismatches equal to float32 noise: SGLang's rows are sampled
inside the server by the decoding step gen-hf runs, from generators seeded the same way, and
every refit reached SGLang whole (a missing or stale weight changes the tokens within a step or
two). The loop's ``shutdown`` leaves no server process or staged file behind.
"""

from __future__ import annotations

from pathlib import Path

from example_modules import load_example
from gen_interface.weights.shm import owner_tag, segment_dir
from gen_sglang.checkpoint import STAGED_PREFIX
from gen_testkit.models import TinyModel


def _servers_and_staging() -> tuple[set[int], set[str]]:
    """The SGLang server processes running; this process's staged checkpoints and servers'
    temp directories, and SGLang's slot files in shared memory."""
    servers = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"gen_sglang_launch" in command or b"sglang.launch_server" in command:
                servers.add(int(entry.name))
    staged = {p.name for p in segment_dir().glob(f"{STAGED_PREFIX}{owner_tag()}-*")}
    staged |= {p.name for p in Path("/dev/shm").glob("sglang_loads_*")}  # SGLang's own
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
