"""FLEET_ALERT_WEBHOOK: each new alert row is POSTed once as JSON.

The alert tick marks a new row `webhook_state = 'pending'` in the same transaction that opens it,
so a delivery can be neither lost nor invented by a crash. This sender then posts each pending
row, retrying with exponential backoff and jitter, and marks it `delivered` (any 2xx) or `failed`
(attempts used up, or a 4xx other than 408/425/429, which no retry can mend). A restart picks up
the rows still pending, with the attempts they already used counted (webhook_attempts).

Past alerts.WEBHOOK_PER_WINDOW rows a minute, the alert tick marks the rest of its new rows
`folded` and one of them carries a summary of them (`webhook_summary`): that one is posted as an
`alert-summary`, so a burst of failing jobs is a few messages, not one per job.

A row is never posted again once delivered, and never by two tasks at once. The one gap no
sender can close: the receiver took the POST but the reply was lost (timeout, crash before the
commit), so the row is retried. Every POST therefore carries the same `Idempotency-Key` and
`delivery_id` for a row, so a receiver can drop the repeat.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from fleet_min.collector.automation.alerts import WEBHOOK_PER_WINDOW, alert_record
from fleet_min.db import Database
from fleet_min.timeutil import now

log = logging.getLogger("fleet_min.collector.webhook")

MAX_BACKOFF_S = 300.0
PARALLEL = 4
_RETRYABLE_4XX = {408, 425, 429}


@dataclass(frozen=True)
class WebhookConfig:
    url: str
    attempts: int = 10
    backoff_s: float = 2.0
    timeout_s: float = 10.0


def backoff(attempt: int, base_s: float, rng: Callable[[], float] = random.random) -> float:
    """Delay before retry number `attempt` (1-based): base * 2^(attempt-1), capped, times a
    random factor in [0.5, 1) so that many collectors do not retry in step."""
    return min(MAX_BACKOFF_S, base_s * 2 ** (attempt - 1)) * (0.5 + rng() / 2)


def chat_text(text: str) -> str:
    """Text as chat services read the `text` field, where anyone who can fail a job writes
    part of it. Slack's `<...>` is markup (a job's error of `<!channel>` would ping everyone,
    `<https://x|label>` show a link under its poster's label), and so is Markdown where
    Mattermost and others render it: `[label](url)` a disguised link, `![x](url)` an image
    every reader's client fetches, `@channel` and `@all` a ping to everyone, a line of its own
    `[1]: url` a link definition. The text is made one line, the `<...>` escaped, and a
    zero-width space set after each `@` and between `]` and `(`: the words read the same and
    none of them is markup."""
    one_line = " ".join(text.split())
    escaped = one_line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return escaped.replace("@", "@\u200b").replace("](", "]\u200b(")


def payload(row: Any, collector: dict[str, str]) -> dict[str, Any]:
    record = alert_record(row, now())
    line = f"{record['rule']} {record['subject']}: {record['detail']}"
    summary = json.loads(row["webhook_summary"]) if row["webhook_summary"] else None
    if summary is None:
        text = chat_text(f"[{collector.get('name', '')}] {line}")
        return {"type": "alert",
                "delivery_id": f"{collector.get('collector', '')}:alert:{row['id']}",
                "collector": collector, "alert": record, "text": text}
    rules = ", ".join(f"{rule} {count}" for rule, count in sorted(summary["rules"].items()))
    text = chat_text(f"[{collector.get('name', '')}] {summary['alerts']} new alerts at once, "
                     f"past the {WEBHOOK_PER_WINDOW} a minute posted one by one ({rules}); "
                     f"the first: {line}. The dashboard lists them all.")
    return {"type": "alert-summary",
            "delivery_id": f"{collector.get('collector', '')}:alerts:{row['id']}",
            "collector": collector, "alert": record,
            "summary": {"alerts": summary["alerts"], "rules": summary["rules"],
                        "first_id": row["id"], "last_id": summary["last_id"]},
            "text": text}


class WebhookSender:
    """Posts pending alert rows; `wake()` after a tick that opened rows, `run()` as a loop."""

    def __init__(self, db: Database, config: WebhookConfig,
                 collector: Callable[[], dict[str, str]]) -> None:
        self.db = db
        self.config = config
        self.collector = collector
        self._wake = asyncio.Event()
        self._in_flight: dict[int, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(PARALLEL)
        self.delivered = 0
        self.failed = 0

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                while True:
                    self._wake.clear()
                    for alert_id in await self._pending():
                        if alert_id not in self._in_flight:
                            task = asyncio.create_task(self._deliver(session, alert_id))
                            self._in_flight[alert_id] = task
                            task.add_done_callback(functools.partial(self._done, alert_id))
                    await self._wake.wait()
            finally:
                for task in list(self._in_flight.values()):
                    task.cancel()
                await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    def _done(self, alert_id: int, _task: asyncio.Task[None]) -> None:
        self._in_flight.pop(alert_id, None)

    async def _pending(self) -> list[int]:
        rows = await self.db.read("SELECT id FROM alerts WHERE webhook_state = 'pending' "
                                  "ORDER BY id LIMIT 1000")
        return [int(row["id"]) for row in rows]

    async def _deliver(self, session: aiohttp.ClientSession, alert_id: int) -> None:
        try:
            while (attempt := await self._attempt(session, alert_id)) is not None:
                await asyncio.sleep(backoff(attempt, self.config.backoff_s))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("webhook delivery of alert %s stopped on an error; it stays "
                          "pending and is retried after a restart", alert_id)

    async def _attempt(self, session: aiohttp.ClientSession, alert_id: int) -> int | None:
        """One attempt, in one of the PARALLEL slots: the attempt's number when it is to be
        retried, None when the row is settled. The wait before a retry holds no slot: four rows
        the receiver keeps refusing held all of them through their backoffs (minutes), and
        every other new alert waited behind them."""
        async with self._slots:
            attempt = await self.db.write(_start_attempt, alert_id, self.config.attempts)
            if attempt is None:
                return None  # no longer pending (or attempts already used up: marked failed)
            row = await self.db.read_one("SELECT * FROM alerts WHERE id = ?", (alert_id,))
            if row is None:
                return None
            outcome = await self._post(session, row, attempt)
            if outcome == "delivered" or outcome == "failed":
                await self.db.write(_finish, alert_id, outcome)
                self.delivered += outcome == "delivered"
                self.failed += outcome == "failed"
                return None
            if attempt >= self.config.attempts:
                log.warning("webhook gave up on alert %s after %d attempts", alert_id, attempt)
                await self.db.write(_finish, alert_id, "failed")
                self.failed += 1
                return None
            return attempt

    async def _post(self, session: aiohttp.ClientSession, row: Any, attempt: int) -> str:
        """'delivered', 'failed' (never retry) or 'retry'."""
        body = payload(row, self.collector())
        headers = {"Idempotency-Key": body["delivery_id"], "User-Agent": "fleet-min-collector"}
        try:
            async with session.post(self.config.url, json=body, headers=headers,
                                    allow_redirects=False) as resp:
                # Only the status counts. The body is left unread: a receiver could send one
                # without end, and leaving the block without it closes the connection.
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.info("webhook attempt %d for alert %s: %s", attempt, row["id"],
                     type(exc).__name__)
            return "retry"
        if 200 <= status < 300:
            return "delivered"
        log.info("webhook attempt %d for alert %s: HTTP %d", attempt, row["id"], status)
        if 300 <= status < 500 and status not in _RETRYABLE_4XX:
            log.warning("webhook refused alert %s with HTTP %d; not retrying (check "
                        "FLEET_ALERT_WEBHOOK)", row["id"], status)
            return "failed"
        return "retry"


def _start_attempt(conn: Any, alert_id: int, max_attempts: int) -> int | None:
    """Count an attempt before making it, so that a restart never grants extra ones."""
    row = conn.execute("SELECT webhook_state, webhook_attempts FROM alerts WHERE id = ?",
                       (alert_id,)).fetchone()
    if row is None or row["webhook_state"] != "pending":
        return None
    if row["webhook_attempts"] >= max_attempts:
        conn.execute("UPDATE alerts SET webhook_state = 'failed' WHERE id = ?", (alert_id,))
        return None
    conn.execute("UPDATE alerts SET webhook_attempts = webhook_attempts + 1 WHERE id = ?",
                 (alert_id,))
    return int(row["webhook_attempts"]) + 1


def _finish(conn: Any, alert_id: int, outcome: str) -> None:
    conn.execute("UPDATE alerts SET webhook_state = ? WHERE id = ? AND webhook_state = 'pending'",
                 (outcome, alert_id))
