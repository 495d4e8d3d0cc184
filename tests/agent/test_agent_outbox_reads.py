"""The outbox reads a spooled row's file only when it must: the collector it names once per
process, its body when it is about to be posted. A flush against a collector that is down
reads at most one request's worth of its backlog, not all of it.

Reads are shown by what they would do: a spooled file whose bytes are replaced by garbage is
set aside (moved to rejected/) by any flush that reads it, so garbage that stays in the spool
through many flushes was never read.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FLUSHES = 5  # flushes while the collector is down, each one a chance to read the backlog


class Receiver:
    """A stand-in collector on a port reserved up front: refusing connections until start()
    (the socket is bound but not listening), then recording every row posted to /results."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.bodies: list[object] = []
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                bodies.append(body)
                reply = b'{"ok": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        server = ThreadingHTTPServer(self.sock.getsockname(), Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = self.sock
        self.sock.listen(16)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.server = server

    def rows(self) -> list[dict]:
        return [row for body in self.bodies for row in (body if isinstance(body, list) else [body])]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        else:
            self.sock.close()


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make() -> Receiver:
        made.append(Receiver())
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


def row(job_id: str, number: int) -> dict:
    return {"job_id": job_id, "device_id": "d", "iter": number, "final": False}


def garble(paths: list[str]) -> None:
    for path in paths:
        Path(path).write_bytes(b"\x00not a spooled row")


def rejected(spool: Path) -> list[str]:
    return sorted(p.name for p in (spool / "rejected").iterdir())


def test_flushes_against_a_down_collector_leave_its_backlog_unread(fa, tmp_path, receivers):
    spool = tmp_path / "spool"
    outbox = fa.Outbox(str(spool))
    down, up = receivers(), receivers()
    up.start()
    total = 2000
    for number in range(total):
        outbox.put(down.url, row("backlog", number))
    paths = outbox.pending()
    assert len(paths) == total
    # Beyond the first request's worth, every tenth spooled row is now garbage on disk.
    spoiled = paths[fa.BATCH_ROWS::10]
    garble(spoiled)
    for _ in range(FLUSHES):
        outbox.put(up.url, row("fresh", 1))  # other collectors' rows still go at once
        assert outbox.flush(up.url) is True
        assert outbox.flush(down.url) is False
        assert outbox.flush() is False
    assert rejected(spool) == [], "a flush read rows of a collector that is down"
    assert outbox.pending(down.url) == paths  # counted without reading them either
    assert [r["job_id"] for r in up.rows()] == ["fresh"] * FLUSHES

    down.start()  # the collector comes back: its rows go in order, the garbage aside
    assert outbox.flush() is True
    spoiled_names = {Path(p).name for p in spoiled}
    assert [r["iter"] for r in down.rows()] == [
        n for n, p in enumerate(paths) if Path(p).name not in spoiled_names]
    assert all(isinstance(body, list) and len(body) <= fa.BATCH_ROWS for body in down.bodies)
    assert set(rejected(spool)) == spoiled_names
    assert outbox.pending() == []


def test_a_spool_left_by_an_earlier_run_is_read_once_and_delivered_in_order(fa, tmp_path,
                                                                          receivers):
    spool = tmp_path / "spool"
    first, second = receivers(), receivers()
    earlier = fa.Outbox(str(spool))  # an earlier run spooled rows and stopped
    per_collector = 3 * fa.BATCH_ROWS
    for number in range(per_collector):
        earlier.put(first.url, row("one", number))
        earlier.put(second.url, row("two", number))
    malformed = spool / f"{1:020d}-000001.json"  # the oldest name, so listed first
    malformed.write_text(json.dumps({"collector": second.url}))  # no row in it
    del earlier

    outbox = fa.Outbox(str(spool))
    assert outbox.flush() is False  # neither collector listens yet
    assert rejected(spool) == [malformed.name]
    backlog = outbox.pending(first.url)
    assert len(backlog) == per_collector and len(outbox.pending(second.url)) == per_collector
    # Now every row of the first collector's but its first request's is garbage on disk.
    garble(backlog[fa.BATCH_ROWS:])
    for _ in range(FLUSHES):
        assert outbox.flush() is False
    assert rejected(spool) == [malformed.name], "rows an earlier run left were read again"

    second.start()  # its rows go in order, the first collector's all stay
    assert outbox.flush(second.url) is True
    assert [r["iter"] for r in second.rows()] == list(range(per_collector))
    assert {r["job_id"] for r in second.rows()} == {"two"}
    assert outbox.pending(first.url) == backlog
    assert rejected(spool) == [malformed.name]

    first.start()
    assert outbox.flush() is True
    assert [r["iter"] for r in first.rows()] == list(range(fa.BATCH_ROWS))
    assert {r["job_id"] for r in first.rows()} == {"one"}
    assert len(rejected(spool)) == 1 + per_collector - fa.BATCH_ROWS
    assert outbox.pending() == []


def test_iteration_rows_and_a_final_row_from_an_earlier_run_keep_their_order(fa, tmp_path,
                                                                             receivers):
    spool = tmp_path / "spool"
    first, second = receivers(), receivers()
    earlier = fa.Outbox(str(spool))
    for number in (1, 2, 3):
        earlier.put(first.url, row("a", number))
        earlier.put(second.url, row("b", number))
    earlier.put(second.url, {**row("b", 0), "final": True})
    earlier.put(first.url, {**row("a", 0), "final": True})
    (spool / f"{2:020d}-000001.json").write_bytes(b"{not json")  # a torn file, by hand
    del earlier

    outbox = fa.Outbox(str(spool))
    first.start()
    second.start()
    assert outbox.flush() is True
    assert [(r["iter"], r["final"]) for r in first.rows()] == [
        (1, False), (2, False), (3, False), (0, True)]
    assert [(r["iter"], r["final"]) for r in second.rows()] == [
        (1, False), (2, False), (3, False), (0, True)]
    assert {r["job_id"] for r in first.rows()} == {"a"}
    assert rejected(spool) == [f"{2:020d}-000001.json"]
    assert outbox.delivered == {first.url: 4, second.url: 4}
    assert outbox.pending() == []


def test_a_row_past_its_bound_is_spooled_without_its_workloads_fields(fa, tmp_path, receivers):
    """A workload copies what a collector or an input hands it into its rows; one past
    MAX_ROW_BYTES keeps only what says which job and device it is, and says why."""
    outbox = fa.Outbox(str(tmp_path / "spool"))
    receiver = receivers()
    receiver.start()
    huge = {**row("big", 3), "ok": True, "attempt": 2, "metrics": {"n": 1},
            "source": "s" * fa.MAX_ROW_BYTES}
    outbox.put(receiver.url, huge)
    outbox.put(receiver.url, {**row("big", 4), "source": "s" * 200})
    assert outbox.flush() is True
    cut, kept = receiver.rows()
    assert cut["job_id"] == "big" and cut["iter"] == 3 and cut["attempt"] == 2
    assert cut["ok"] is False and cut["final"] is False and cut["metrics"] == {}
    assert "source" not in cut
    assert f"more than the {fa.MAX_ROW_BYTES} a row may carry" in cut["error"]
    assert kept["source"] == "s" * 200


def test_a_backlog_goes_in_requests_of_bounded_bytes(fa, tmp_path, receivers):
    """Rows that piled up go BATCH_ROWS at a time, and never more than BATCH_BYTES of them in
    one request: the collector's bodies stop at 1 MiB, and the agent reads only what it sends."""
    outbox = fa.Outbox(str(tmp_path / "spool"))
    receiver = receivers()
    wide = "w" * (fa.BATCH_BYTES // 5)
    for number in range(40):
        outbox.put(receiver.url, {**row("wide", number), "note": wide})
    for number in range(40, 40 + 2 * fa.BATCH_ROWS):
        outbox.put(receiver.url, row("narrow", number))
    assert outbox.flush() is False  # not listening yet
    receiver.start()
    assert outbox.flush() is True
    assert [r["iter"] for r in receiver.rows()] == list(range(40 + 2 * fa.BATCH_ROWS))
    sizes = [len(json.dumps(body)) for body in receiver.bodies]
    assert max(sizes) <= fa.BATCH_BYTES
    assert all(isinstance(body, list) and len(body) <= fa.BATCH_ROWS for body in receiver.bodies)
    assert len([b for b in receiver.bodies if b[0]["job_id"] == "wide"]) >= 40 // 5


def test_a_full_spool_refuses_iteration_rows_but_never_a_final_row(fa, tmp_path, receivers):
    """Past its bound the spool takes no more iteration rows (SpoolFull, a refusal that ends
    the job with a sentence) but still the final row; delivering the backlog makes room."""
    spool = tmp_path / "spool"
    receiver = receivers()
    outbox = fa.Outbox(str(spool), max_bytes=64 << 10)
    number = 0
    with pytest.raises(fa.SpoolFull) as refused:
        while number < 10_000:
            outbox.put(receiver.url, {**row("long", number), "note": "n" * 1000})
            number += 1
    assert "the job stops adding rows" in str(refused.value)
    assert isinstance(refused.value, fa.Refusal)
    held = sum(p.stat().st_size for p in spool.glob("*.json"))
    assert 64 << 10 < held < (64 << 10) + 4096  # one row past the bound, no more
    outbox.put(receiver.url, {**row("long", 0), "final": True})
    assert len(outbox.pending()) == number + 1
    # A restarted agent measures what an earlier run left.
    assert fa.Outbox(str(spool), max_bytes=64 << 10).held == outbox.held
    receiver.start()
    assert outbox.flush() is True
    assert outbox.held == 0
    outbox.put(receiver.url, row("long", number))
    assert outbox.flush() is True
    assert [r["iter"] for r in receiver.rows()] == [*range(number), 0, number]
