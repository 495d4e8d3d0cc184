"""Room in a bounded registry: before a new entry is stored in a full table, the entries that
may give way are deleted, longest gone first, or the new one is refused.

The device registry and the host executors' each keep a bound (anyone who can reach the port
could otherwise add rows for ever, and every listing reads them all). Each has its own rule for
which entries may give way; the counting, the deleting and the refusal are the same, and live
here.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet_min.errors import RegistryFull


@dataclass(frozen=True)
class BoundedTable:
    """A table with a bound: its name and key column (constants of the code, never input), and
    `gone_sql`, a SELECT of the keys that may give way, longest gone first, whose last
    parameter is how many to take (its others are given to make_room)."""

    table: str
    key: str
    gone_sql: str


def make_room(conn: sqlite3.Connection, bounded: BoundedTable, bound: int,
              params: Sequence[Any], refusal: Callable[[int], str]) -> list[str]:
    """Make room for one more entry: delete as many entries that may give way as it takes and
    return their keys (none while the table is under its bound). Raise RegistryFull (507) with
    `refusal(count)` when not enough may give way; the caller's transaction is then undone,
    deletions included, so a refusal changes nothing."""
    count = conn.execute(f"SELECT COUNT(*) FROM {bounded.table}").fetchone()[0]
    if count < bound:
        return []
    gone = [row[0] for row in conn.execute(bounded.gone_sql, (*params, count - bound + 1))]
    if count - len(gone) >= bound:
        raise RegistryFull(refusal(count))
    conn.executemany(f"DELETE FROM {bounded.table} WHERE {bounded.key} = ?",
                     [(key,) for key in gone])
    return gone
