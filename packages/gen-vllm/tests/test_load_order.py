"""A worker lets the loads of an update into its engine in the order the driver handed them
over, whatever order Ray starts its calls in; a load left waiting when its update ends fails
without being queued."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from gen_interface import WeightUpdateError
from gen_vllm.load_order import LoadOrder


async def _arrive(order: LoadOrder, places: list[int], queued: list[int]) -> None:
    async def load(place: int) -> None:
        async with order.turn(place):
            queued.append(place)

    await asyncio.wait_for(asyncio.gather(*(load(p) for p in places)), timeout=5)


@pytest.mark.parametrize("arrival", list(itertools.permutations(range(4))))
def test_loads_are_queued_in_their_order_whatever_order_they_arrive_in(arrival):
    async def run() -> list[int]:
        order, queued = LoadOrder(), []
        await order.new_update()
        await _arrive(order, list(arrival), queued)
        return queued

    assert asyncio.run(run()) == [0, 1, 2, 3]


def test_each_update_counts_its_loads_from_zero():
    async def run() -> list[int]:
        order, queued = LoadOrder(), []
        await order.new_update()
        await _arrive(order, [1, 0], queued)
        await order.new_update()
        await _arrive(order, [1, 0], queued)
        return queued

    assert asyncio.run(run()) == [0, 1, 0, 1]


def test_a_load_still_waiting_when_its_update_ends_fails_unqueued():
    async def run() -> tuple[BaseException | None, list[int]]:
        order, queued = LoadOrder(), []
        await order.new_update()
        late = asyncio.ensure_future(_arrive(order, [2], queued))  # 0 and 1 never came
        await asyncio.sleep(0.05)
        assert not late.done()
        await order.new_update()
        error = await asyncio.wait_for(asyncio.gather(late, return_exceptions=True), 5)
        return error[0], queued

    error, queued = asyncio.run(run())
    assert isinstance(error, WeightUpdateError) and "after that update ended" in str(error)
    assert queued == []
