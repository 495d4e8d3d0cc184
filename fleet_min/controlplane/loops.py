"""Waiting and stopping for the daemon's background loops, safe against lost cancellations.

Why not asyncio.wait_for: on Python 3.11 it returns the inner result when a cancellation
arrives in the same loop iteration as that result (an event set just before close(), a command
that exits as the daemon stops). The cancel is then lost, a `while True` loop goes round again,
and whoever awaits the task at shutdown waits for ever. asyncio.timeout() counts cancellations
(Task.cancelling/uncancel) and always lets an outside cancel through, so every wait in the
control plane goes through it; stop_tasks() re-cancels anything that still survives, so a
cancel swallowed by code we do not own cannot hang a shutdown either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True once the event is set, False after timeout_s; a cancel always propagates."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


class Pacer:
    """When a background loop runs next: `interval()` seconds after its last round began, at
    once when poked, and re-timed at once when the interval changes.

    A live setting (tick_s, github_s, history_s) changed from 300 to 5 must not wait out the 300
    s already begun, and one changed from 5 to 300 must not start a round now: `retime()` makes
    the waiting loop measure again from its last round with the new value. `poke()` asks for a
    round now (after an action, say) and is kept if it arrives while a round is running.
    """

    def __init__(self, interval: Callable[[], float]) -> None:
        self.interval = interval
        self._event = asyncio.Event()
        self._now = False

    def poke(self) -> None:
        self._now = True
        self._event.set()

    def retime(self) -> None:
        self._event.set()

    async def wait(self, since: float) -> None:
        """Return when the next round is due; `since` is time.monotonic() of the last one."""
        while not self._now:
            remaining = since + self.interval() - time.monotonic()
            if remaining <= 0:
                break
            await wait_event(self._event, remaining)
            self._event.clear()
        self._now = False


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], grace_s: float = 2.0) -> None:
    """Cancel the tasks and wait until every one has ended, cancelling again each grace_s."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            log.warning("task %s outlived its cancellation; cancelling it again",
                        task.get_name())
            task.cancel()
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s had failed", task.get_name(), exc_info=task.exception())
