"""Shutdown never hangs on a lost cancellation (the teardown hang of the deregister test), and
the loops keep their pace when a live setting changes.

On Python 3.11, asyncio.wait_for returns the inner result when a cancel arrives together with it;
the snapshot's tick loop then went round again and the shutdown waited for it for ever. These
tests set the event (or finish the inner work) in the same breath as the cancel, the
interleaving that lost it. The loops run here as the app runs them, without the app: the plane,
the snapshot and the GitHub refresh alone.
"""

from __future__ import annotations

import asyncio

from fleet_min.controlplane.github.sync import GitHubSync
from fleet_min.controlplane.live import LiveSettings
from fleet_min.controlplane.loops import stop_tasks, wait_event
from fleet_min.controlplane.snapshot import Snapshots
from tests.support.controlplane import Host, open_parts, running, until

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


def _loop_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("controlplane-")]


async def test_the_loops_stop_right_after_a_wake(host: Host) -> None:
    host.add_runner("r1")
    for spins in range(4):
        async with open_parts(host) as parts:
            snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
            sync = GitHubSync(parts.plane, parts.github, snapshots)
            stack = running(snapshots.running, sync.running)
            await stack.__aenter__()
            await asyncio.sleep(0.2)  # both loops are waiting now
            tasks = _loop_tasks()
            assert len(tasks) == 2
            parts.plane.wake(github=True)
            for _ in range(spins):
                await asyncio.sleep(0)
            async with asyncio.timeout(HANG_GUARD_S):
                await stack.__aexit__(None, None, None)
            assert all(task.done() for task in tasks) and not _loop_tasks()


async def test_a_setting_change_rebuilds_once_and_the_tick_takes_the_new_interval(
        apply_env: Host) -> None:
    host = apply_env  # the fake systemctl on this process's PATH
    host.add_runner("r1", repo="octo/app")
    env = {**host.full_env(), "FLEET_TICK_S": "3600", "FLEET_BUSY_TICK_S": "3600",
           "FLEET_GITHUB_S": "3600"}
    async with open_parts(host, env) as parts:
        snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
        live = LiveSettings(parts.plane, snapshots)
        sync = GitHubSync(parts.plane, parts.github, snapshots)
        async with asyncio.timeout(HANG_GUARD_S), running(snapshots.running, sync.running):
            await until(lambda: snapshots.ticks >= 2)  # the first build and the GitHub loop's
            await asyncio.sleep(0.3)
            settled = snapshots.ticks
            reply = await live.apply("grouping", "owner", False)
            assert reply["value"] == "owner" and snapshots.ticks == settled + 1
            assert [g["key"] for g in parts.plane.snapshot["groups"]] == ["octo"]
            await asyncio.sleep(0.5)  # the tick loop woke up for the interval, and only for it
            assert snapshots.ticks == settled + 1
            parts.plane.wake()  # a plain wake still asks for a rebuild
            await until(lambda: snapshots.ticks == settled + 2)
            await live.apply("tick_s", 0.2, False)  # not after the old 3600 s
            changed = snapshots.ticks
            await until(lambda: snapshots.ticks >= changed + 3)
