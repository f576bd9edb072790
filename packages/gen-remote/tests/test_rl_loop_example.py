"""``examples/reinforce_loop.py`` against a local gen-hf and against the remote backend over a
gen-serve server with gen-hf behind, whole and with deltas: the same seeds give the same
rewards, weight versions and logprob mismatch, step for step, and the delta refits send less.
Both generate batch-invariant, so that a row's logprobs do not depend on the rows beside it
(the server runs each row as a request of its own)."""

from __future__ import annotations

from example_modules import load_example
from gen_testkit.models import TinyModel
from servers import hf_backend, serve


def test_the_loop_is_the_same_over_http_as_in_process(tiny_qwen2: TinyModel):
    example = load_example("reinforce_loop")
    model = str(tiny_qwen2.path)
    local = example.run(model, steps=3, seed=5, batch_invariant=True)
    server = serve(hf_backend(tiny_qwen2, batch_invariant=True), tiny_qwen2)
    try:
        remote = example.run(model, base_url=server.url, steps=3, seed=5, batch_invariant=True)
        deltas = example.run(
            model, base_url=server.url, steps=3, seed=5, batch_invariant=True, deltas=True
        )
    finally:
        server.stop()
    for run in (remote, deltas):
        assert [s.reward for s in run] == [s.reward for s in local]
        assert [s.mismatch for s in run] == [s.mismatch for s in local]
    assert [s.weight_version for s in remote] == [1, 2, 3]
    # The second run refits the same server on from where the first left it: every step one
    # committed version, each newer than the first run's.
    versions = [s.weight_version for s in deltas]
    assert versions == list(range(versions[0], versions[0] + 3)) and versions[0] > 3, versions
    assert [s.weight_version for s in local] == [1, 2, 3]
    assert len({s.reward for s in local}) > 1  # the policy moved: the steps differ
    assert all(s.sent_bytes == s.whole_bytes > 0 for s in remote)
    # unused embedding rows stay as they were: every step's refit sends less than the weights
    assert all(0 < s.sent_bytes < s.whole_bytes for s in deltas)
