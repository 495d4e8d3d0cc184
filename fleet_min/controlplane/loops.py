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
from collections.abc import Iterable
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
