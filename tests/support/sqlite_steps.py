"""Work measured as SQLite counts it: virtual-machine steps, through a progress handler. Unlike a
time, the count does not depend on how fast or how busy this machine is, so a test can hold a
cost to how it grows (four times the input, about four times the steps)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def counted_steps(conn: sqlite3.Connection, every: int = 100) -> Iterator[list[int]]:
    """Count the connection's virtual-machine steps while the block runs, in units of `every`
    instructions: the count is the list's one item once the block is done."""
    taken = [0]

    def step() -> int:
        taken[0] += 1
        return 0  # go on

    conn.set_progress_handler(step, every)
    try:
        yield taken
    finally:
        conn.set_progress_handler(None, 0)
