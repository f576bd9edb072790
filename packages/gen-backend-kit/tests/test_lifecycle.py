"""The shared lifecycle: transitions, tags, weight updates while asleep, front ends, failures."""

from __future__ import annotations

import pytest
from gen_backend_kit.lifecycle import RESOURCES, Lifecycle
from gen_interface import GenerationError, GenerationInputError, WeightUpdateError
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule


class FakeDevice:
    """Memory that can sleep like vLLM's allocator: writing to sleeping weights fails loudly,
    and level-1 wake-up restores the backup taken at sleep."""

    def __init__(self, sleeps: bool = True):
        self.sleeps = sleeps
        self.mapped = set(RESOURCES)
        self.weights = 0
        self.backup: int | None = None
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.closed = 0

    def wake(self, resources):
        self.calls.append(("wake", resources))
        for resource in resources:
            assert resource not in self.mapped, f"woke {resource}, which was awake"
            self.mapped.add(resource)
            if resource == "weights" and self.backup is not None:
                self.weights, self.backup = self.backup, None

    def release(self):
        self.calls.append(("release", ()))
        if not self.sleeps:
            return frozenset()
        self.backup = self.weights
        self.mapped.clear()
        return frozenset(RESOURCES)

    def close(self):
        self.closed += 1

    def write_weights(self, value: int) -> None:
        if "weights" not in self.mapped:
            raise RuntimeError("illegal memory access: the weights are unmapped")
        self.weights = value

    def lifecycle(self, **kwargs) -> Lifecycle:
        return Lifecycle(
            "TestBackend", wake=self.wake, release=self.release, close=self.close, **kwargs
        )


def test_finish_then_prepare_wakes_weights_before_the_cache():
    device = FakeDevice()
    life = device.lifecycle()
    life.finish()
    assert life.state == "finished" and life.asleep == set(RESOURCES)
    with pytest.raises(GenerationError, match="after finish_generation"):
        life.check_can_generate()
    life.prepare()
    assert device.calls[-1] == ("wake", ("weights", "kv_cache"))
    assert life.state == "ready" and not life.asleep
    life.prepare()  # idempotent: nothing to wake
    assert device.calls[-1] == ("wake", ("weights", "kv_cache"))


def test_an_update_while_asleep_wakes_only_the_weights_and_keeps_the_new_ones():
    device = FakeDevice()
    life = device.lifecycle()
    device.write_weights(1)
    life.finish()
    with life.updating_weights():
        device.write_weights(2)
    assert life.asleep == {"kv_cache"} and life.state == "finished"
    with pytest.raises(GenerationError, match=r"\['kv_cache'\] still asleep"):
        life.check_can_generate()
    life.prepare(tags=["kv_cache"])
    assert life.state == "ready" and device.weights == 2  # the old backup did not come back


def test_nemo_rl_refit_order_with_tags():
    device = FakeDevice()
    life = device.lifecycle()
    life.finish()
    life.prepare(tags=["weights"])
    assert life.state == "finished" and life.asleep == {"kv_cache"}
    with life.updating_weights():
        device.write_weights(5)
    life.prepare(tags=["kv_cache"])
    assert life.state == "ready"
    assert [c for c in device.calls if c[0] == "wake"] == [
        ("wake", ("weights",)),
        ("wake", ("kv_cache",)),
    ]
    with pytest.raises(GenerationInputError, match="tags must be among"):
        life.prepare(tags=["weight"])


def test_a_backend_without_sleep_is_ready_after_any_prepare():
    device = FakeDevice(sleeps=False)
    life = device.lifecycle()
    life.finish()
    life.prepare(tags=["weights"])
    assert life.state == "ready"


def test_views_share_the_state_and_close_alone():
    device = FakeDevice()
    life = device.lifecycle()
    view = life.view()
    life.finish()
    with pytest.raises(GenerationError, match="after finish_generation"), view.generating():
        pass
    view.prepare()
    assert life.state == "ready"
    view.shutdown()
    with pytest.raises(GenerationError, match=r"front end .* is shut down; its owner"):
        view.check_can_generate()
    with life.generating():
        pass  # the owner is untouched
    other = life.view()
    life.shutdown()
    with pytest.raises(GenerationError, match="is shut down; build a new one"):
        other.check_can_generate()
    assert device.closed == 1


def test_broken_refuses_everything_but_shutdown():
    device = FakeDevice()
    life = device.lifecycle()
    life.mark_broken("replica 1 kept the old weights")
    for call in (life.check_can_generate, life.prepare):
        with pytest.raises(GenerationError, match=r"broken .*replica 1 kept the old weights"):
            call()
    with pytest.raises(WeightUpdateError, match="broken"), life.updating_weights():
        pass
    life.shutdown()
    life.shutdown()
    assert life.state == "shut down" and device.closed == 1


def test_finish_refuses_while_a_call_runs():
    life = FakeDevice().lifecycle()
    with life.generating(), pytest.raises(GenerationError, match="1 generate call"):
        life.finish()
    life.finish()
    assert life.state == "finished"


def test_absent_weights_refuse_generation_until_an_update_commits():
    life = FakeDevice().lifecycle(weights_absent="started without reading the checkpoint")
    with pytest.raises(GenerationError, match=r"no real weights yet .*without reading"):
        life.check_can_generate()
    with life.updating_weights():
        pass
    life.weights_arrived()
    life.check_can_generate()


class LifecycleMachine(RuleBasedStateMachine):
    """Any sequence of calls keeps the lifecycle's promises."""

    def __init__(self):
        super().__init__()
        self.device = FakeDevice()
        self.life = self.device.lifecycle()
        self.final = False

    @rule()
    def finish(self):
        self.life.finish()

    @rule(tags=st.none() | st.lists(st.sampled_from(RESOURCES), unique=True))
    def prepare(self, tags):
        try:
            self.life.prepare(tags)
        except GenerationError:
            assert self.final

    @rule(value=st.integers())
    def update(self, value):
        try:
            with self.life.updating_weights():
                self.device.write_weights(value)  # raises if the lifecycle wrote while asleep
        except WeightUpdateError:
            assert self.final

    @rule()
    def generate(self):
        try:
            with self.life.generating():
                assert set(RESOURCES) <= self.device.mapped, "generating on sleeping memory"
        except GenerationError:
            assert self.final or self.life.state == "finished"

    @precondition(lambda self: not self.final)
    @rule(broken=st.booleans())
    def end(self, broken):
        if broken:
            self.life.mark_broken("test")
        else:
            self.life.shutdown()
        self.final = True

    @invariant()
    def asleep_matches_the_device(self):
        if self.life.state != "shut down":
            assert self.life.asleep == set(RESOURCES) - self.device.mapped

    @invariant()
    def closed_at_most_once(self):
        assert self.device.closed <= 1


TestLifecycleMachine = LifecycleMachine.TestCase
TestLifecycleMachine.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)
