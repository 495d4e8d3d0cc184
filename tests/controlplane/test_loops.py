"""Shutdown never hangs on a lost cancellation (the teardown hang of the deregister test).

On Python 3.11, asyncio.wait_for returns the inner result when a cancel arrives together with it;
the engine's tick loop then went round again and close() waited for it for ever. These tests set
the event (or finish the inner work) in the same breath as the cancel, the interleaving that
lost it.
"""

from __future__ import annotations

import asyncio

from fleet_min.controlplane.loops import stop_tasks, wait_event
from fleet_min.controlplane.snapshot import ControlPlane
from tests.support.controlplane import Host, make_config, until

HANG_GUARD_S = 60  # not a performance bound: only turns a hang into a failure


async def _forever(event: asyncio.Event) -> None:
    while True:
        await wait_event(event, 5)
        event.clear()


async def test_wait_event_lets_a_cancel_through_whatever_the_interleaving() -> None:
    for spins in range(6):
        event = asyncio.Event()
        task = asyncio.create_task(_forever(event))
        await asyncio.sleep(0.01)
        event.set()
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=HANG_GUARD_S)
        assert task in done and task.cancelled(), spins


async def test_wait_event_reports_set_and_timeout() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 5) is True


async def test_stop_tasks_cancels_again_a_task_that_swallowed_the_first_cancel() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # what a buggy library does
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    async with asyncio.timeout(HANG_GUARD_S):
        await stop_tasks([task], grace_s=0.05)
    assert swallowed.is_set() and task.cancelled()


async def test_engine_close_right_after_a_wake_ends(host: Host) -> None:
    host.add_runner("r1")
    for spins in range(4):
        cp = ControlPlane(make_config(host), host.full_env())
        await cp.open()
        await asyncio.sleep(0.2)  # both loops are waiting now
        cp.wake(github=True)
        for _ in range(spins):
            await asyncio.sleep(0)
        async with asyncio.timeout(HANG_GUARD_S):
            await cp.close()
        assert all(task.done() for task in cp._tasks)


async def test_a_setting_change_rebuilds_once_and_the_tick_takes_the_new_interval(
        apply_env: Host) -> None:
    host = apply_env
    host.add_runner("r1", repo="octo/app")
    env = {**host.full_env(), "FLEET_TICK_S": "3600", "FLEET_BUSY_TICK_S": "3600",
           "FLEET_GITHUB_S": "3600"}
    cp = ControlPlane(make_config(host), env)
    await cp.open()
    try:
        await until(lambda: cp.ticks >= 2)  # open()'s rebuild and the GitHub loop's first
        await asyncio.sleep(0.3)
        settled = cp.ticks
        reply = await cp.change_setting("grouping", "owner", False)
        assert reply["value"] == "owner" and cp.ticks == settled + 1
        assert [g["key"] for g in cp.snapshot["groups"]] == ["octo"]
        await asyncio.sleep(0.5)  # the tick loop woke up for the interval, and only for it
        assert cp.ticks == settled + 1
        cp.wake()  # a plain wake still asks for a rebuild
        await until(lambda: cp.ticks == settled + 2)
        await cp.change_setting("tick_s", 0.2, False)  # not after the old 3600 s
        changed = cp.ticks
        await until(lambda: cp.ticks >= changed + 3)
    finally:
        async with asyncio.timeout(HANG_GUARD_S):
            await cp.close()
