"""The live mirror of a running host job (issue 26), through a real collector (in-process,
real socket, real SQLite file): frames posted by a real HTTP client, read back by a viewer on
the multipart stream; the checks on a frame and its poster; the newest frame only, for a slow
viewer too; nothing served once the job closes; and, in a real collector process, viewers that
never read cannot make it hold more frames than its budget."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleet_min.collector.insight.mirror import Mirrors
from tests.support.collector import (
    CollectorProcess,
    job,
    registration,
    status_kib,
    wait_until,
)

HOLD = "soak"


def jpeg(marker: bytes, size: int = 64) -> bytes:
    """A frame the collector takes as JPEG (its markers; the collector never decodes it)."""
    return b"\xff\xd8\xff\xe0" + marker + b"\0" * max(0, size - len(marker) - 6) + b"\xff\xd9"


async def post_frame(client, job_id, body, query="?executor=lab", headers=None):
    resp = await client.post(f"/api/jobs/{job_id}/mirror{query}", data=body,
                             headers={"Content-Type": "image/jpeg", **(headers or {})})
    text = await resp.text()
    return resp.status, text


async def running(client, job_id="run", executor="lab"):
    resp = await client.post("/jobs", json=job(job_id, workload="soak", executor="host",
                                               params={"app_id": "com.example"}))
    assert resp.status == 201
    resp = await client.get(f"/executor/next-job?name={executor}")
    assert resp.status == 200 and (await resp.json())["job_id"] == job_id


def part_head(boundary: str) -> bytes:
    return f"--{boundary}\r\nContent-Type: image/jpeg\r\n\r\n".encode()


class Frames:
    """The viewer's side of the multipart stream: frame after frame, each ended by the next
    boundary and part head, which the collector sends right after each frame."""

    def __init__(self, response, boundary: str) -> None:
        self.response = response
        self.boundary = boundary
        self.end = b"\r\n" + part_head(boundary)
        self.buffer = b""

    async def next(self) -> bytes:
        while (at := self.buffer.find(self.end)) < 0:
            chunk = await self.response.content.read(1 << 16)
            assert chunk, "the stream ended"
            self.buffer += chunk
        frame, self.buffer = self.buffer[:at], self.buffer[at + len(self.end):]
        return frame

    async def ended(self) -> bool:
        return await self.response.content.read() == b""


async def view(client, job_id="run") -> Frames:
    viewer = await client.get(f"/api/jobs/{job_id}/mirror")
    assert viewer.status == 200
    kind, _, boundary = viewer.headers["Content-Type"].partition("; boundary=")
    assert kind == "multipart/x-mixed-replace" and boundary.startswith("fleet-frame-")
    head = part_head(boundary)
    assert await asyncio.wait_for(viewer.content.readexactly(len(head)), 10) == head
    return Frames(viewer, boundary)


@pytest.fixture
async def mirror(collector_factory):
    return await collector_factory(max_mirror_bytes=2 << 20)


async def test_a_viewer_sees_the_newest_frame_and_the_stream_ends_with_the_job(mirror):
    await running(mirror)
    status = await (await mirror.get("/api/jobs/run/mirror/status")).json()
    assert status == {"streaming": False, "frame_at": None, "viewers": 0}
    assert (await post_frame(mirror, "run", jpeg(b"one")))[0] == 204
    viewer = await view(mirror)
    assert b"one" in await asyncio.wait_for(viewer.next(), 10)
    status = await (await mirror.get("/api/jobs/run/mirror/status")).json()
    assert status["streaming"] is True and status["frame_at"].endswith("Z")
    assert status["viewers"] == 1
    assert (await post_frame(mirror, "run", jpeg(b"two"), query="",
                             headers={"X-Fleet-Executor": "lab"}))[0] == 204
    assert b"two" in await asyncio.wait_for(viewer.next(), 10)
    health = await (await mirror.get("/api/health")).json()
    assert health["mirrored_jobs"] == 1
    resp = await mirror.post("/api/jobs/run/cancel")
    assert resp.status == 200
    assert await asyncio.wait_for(viewer.ended(), 10)  # the stream ended
    resp = await mirror.get("/api/jobs/run/mirror")
    assert resp.status == 404 and "live mirror ended" in (await resp.json())["error"]
    assert (await (await mirror.get("/api/health")).json())["mirrored_jobs"] == 0
    status = await (await mirror.get("/api/jobs/run/mirror/status")).json()
    assert status["streaming"] is False  # nothing is kept past the job
    assert (await mirror.get("/api/jobs/nobody/mirror/status")).status == 404
    status, text = await post_frame(mirror, "run", jpeg(b"late"))
    assert status == 409 and "only a running host job is mirrored" in text


async def test_a_slow_viewer_gets_the_newest_frame_not_a_backlog(mirror):
    await running(mirror)
    assert (await post_frame(mirror, "run", jpeg(b"frame-0", 1 << 20)))[0] == 204
    viewer = await view(mirror)
    # The viewer reads nothing while 40 frames of 1 MiB come: far more than the socket
    # buffers between them hold (a few MiB on loopback).
    for i in range(1, 40):
        assert (await post_frame(mirror, "run", jpeg(b"frame-%d" % i, 1 << 20)))[0] == 204
        await asyncio.sleep(0.02)
    seen = []
    while not seen or seen[-1] != b"frame-39":
        part = await asyncio.wait_for(viewer.next(), 20)
        seen.append(part[4:12].rstrip(b"\0"))
    assert len(seen) < 30, seen  # frames in between were skipped, not queued
    viewer.response.close()


async def test_a_device_attached_to_the_claimant_may_post_its_frames(mirror):
    await mirror.post("/devices/register", json=registration("R5CT", capabilities=[], descriptor={
        "platform": "android", "serial": "R5CT", "attached_to": "lab"}))
    await mirror.post("/devices/register", json=registration("loose"))
    await running(mirror)
    assert (await post_frame(mirror, "run", jpeg(b"x"), query="?device_id=R5CT"))[0] == 204
    status, text = await post_frame(mirror, "run", jpeg(b"x"), query="?device_id=loose")
    assert status == 409 and "name the executor" in text


@pytest.mark.parametrize("body, query, wanted, words", [
    (b"", "?executor=lab", 400, "the frame is empty"),
    (b"\x89PNG\r\n\x1a\n....", "?executor=lab", 400, "not a JPEG"),
    (b"\xff\xd8\xff\xe0 cut short", "?executor=lab", 400, "not a JPEG"),
    (jpeg(b"big", (2 << 20) + 1), "?executor=lab", 413, "larger than"),
    (jpeg(b"x"), "?executor=rig", 409, "not by 'rig'"),
    (jpeg(b"x"), "", 409, "name the executor"),
])
async def test_a_frame_is_checked_before_it_is_kept(mirror, body, query, wanted, words):
    await running(mirror)
    status, text = await post_frame(mirror, "run", body, query=query)
    assert status == wanted and words in text, text
    assert (await (await mirror.get("/api/health")).json())["mirrored_jobs"] == 0


async def test_only_a_running_host_job_is_mirrored(mirror):
    assert (await post_frame(mirror, "nope", jpeg(b"x")))[0] == 404
    assert (await mirror.get("/api/jobs/nope/mirror")).status == 404
    await mirror.post("/jobs", json=job("queued-soak", workload="soak", executor="host"))
    status, text = await post_frame(mirror, "queued-soak", jpeg(b"x"))
    assert status == 409 and "is queued" in text
    resp = await mirror.get("/api/jobs/queued-soak/mirror")
    assert resp.status == 404 and "queued" in (await resp.json())["error"]
    await mirror.post("/devices/register", json=registration("d1"))
    await mirror.post("/jobs", json=job("bench", targets={"device_id": "d1"}))
    await mirror.get("/devices/d1/next-job")
    status, text = await post_frame(mirror, "bench", jpeg(b"x"))
    assert status == 409 and "device job" in text


async def test_a_frame_cannot_start_a_part_of_its_own(mirror):
    """A frame is the poster's bytes between JPEG markers: one holding a boundary and a
    text/html part head must stay inside its image part. Each stream's boundary is its own
    (no poster can know it), and the stream runs nothing whatever a browser makes of it."""
    await running(mirror)
    forged = b"\r\n--fleet-frame\r\nContent-Type: text/html\r\n\r\n<script>alert(1)</script>"
    assert (await post_frame(mirror, "run", jpeg(b"x" + forged, 256)))[0] == 204
    first, second = await view(mirror), await view(mirror)
    assert first.boundary != second.boundary
    for viewer in (first, second):
        assert viewer.response.headers["Content-Security-Policy"] == "default-src 'none'; sandbox"
        frame = await asyncio.wait_for(viewer.next(), 10)
        assert forged in frame and frame.startswith(b"\xff\xd8\xff")
        assert viewer.boundary.encode() not in frame
        viewer.response.close()


async def test_frames_held_together_stay_within_their_budget(collector_factory):
    """Each claimed job may hold a frame, but all of them together stay within
    FLEET_MAX_MIRROR_HELD_BYTES: the frame posted longest ago is let go first, its viewer
    stays, and the job's next post brings it back."""
    client = await collector_factory(max_mirror_bytes=2 << 20,
                                     max_mirror_held_bytes=(5 << 20) // 2)
    for name in ("a", "b", "c"):
        await running(client, job_id=name, executor=f"rig-{name}")
    viewer = await view(client, "a")
    for name in ("a", "b"):
        query = f"?executor=rig-{name}"
        assert (await post_frame(client, name, jpeg(name.encode(), 1 << 20), query))[0] == 204
    assert b"a" in (await asyncio.wait_for(viewer.next(), 10))[4:6]
    health = await (await client.get("/api/health")).json()
    assert health["mirror_held_bytes"] == 2 << 20
    assert (await post_frame(client, "c", jpeg(b"c", 1 << 20), "?executor=rig-c"))[0] == 204

    async def streaming(job_id):
        status = await (await client.get(f"/api/jobs/{job_id}/mirror/status")).json()
        return status["streaming"], status["viewers"]

    assert [await streaming(j) for j in "abc"] == [(False, 1), (True, 0), (True, 0)]
    health = await (await client.get("/api/health")).json()
    assert health["mirror_held_bytes"] == 2 << 20 and health["mirrored_jobs"] == 3
    # a's viewer waited through it and sees a's next frame; b's, now the oldest, goes.
    assert (await post_frame(client, "a", jpeg(b"a2", 1 << 20), "?executor=rig-a"))[0] == 204
    assert (await asyncio.wait_for(viewer.next(), 10))[4:6] == b"a2"
    assert [await streaming(j) for j in "abc"] == [(True, 1), (False, 0), (True, 0)]
    health = await (await client.get("/api/health")).json()
    assert health["mirror_held_bytes"] == 2 << 20 and health["mirrored_jobs"] == 2
    viewer.response.close()


def test_a_frame_still_being_sent_is_held_once_and_the_viewers_furthest_behind_go_first():
    """The budget's bookkeeping itself: a frame a newer one replaced stays held, counted once
    however many viewers are still sent it, until they have taken it; past the budget the
    viewers of the oldest such frame are cut, and a viewer of a newer one stays."""
    mirrors, cut = Mirrors(300), []

    def handed(name: str):
        frame = mirrors.newest("run")
        assert frame is not None
        return mirrors.sending(frame, lambda: cut.append(name))

    mirrors.put("run", b"1" * 100, 0.0)
    slow = [handed("a"), handed("b")]
    assert mirrors.held_bytes == 100  # one bytes object for both
    mirrors.put("run", b"2" * 100, 0.0)
    behind = [handed("c")]
    mirrors.put("run", b"3" * 100, 0.0)
    behind.append(handed("d"))
    assert mirrors.held_bytes == 300 and cut == []  # frames 1 and 2 are still being sent
    mirrors.put("run", b"4" * 100, 0.0)
    assert cut == ["a", "b"] and mirrors.held_bytes == 300  # frame 1 went with its viewers
    for sending in slow + behind:
        mirrors.sent(sending)  # (for a and b, as their streams end: not counted again)
    assert mirrors.held_bytes == 100 and cut == ["a", "b"]
    mirrors.drop("run")
    assert mirrors.held_bytes == 0


# -- viewers that never read, in a real collector process -------------------------------------

MIB = 1 << 20
# The collector under uvloop (which hands a transport the frame's bytes object) or plain asyncio
# (Python 3.11's copies what the socket did not take into a buffer of each connection's own).
_BOOT = ("import sys\n"
         "if sys.argv.pop(1) == 'asyncio': sys.modules['uvloop'] = None\n"
         "from fleet_min.cli import main\n"
         "raise SystemExit(main())\n")


@pytest.fixture
def process(tmp_path: Path) -> Iterator[Callable[..., CollectorProcess]]:
    started: list[CollectorProcess] = []

    def start(loop: str, env: dict[str, str]) -> CollectorProcess:
        argv = [sys.executable, "-c", _BOOT, loop, "collector"]
        started.append(CollectorProcess(tmp_path / "data", argv=argv, env=env).start())
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


def post_frame_to(proc: CollectorProcess, body: bytes) -> None:
    post = urllib.request.Request(f"{proc.url}/api/jobs/run/mirror?executor=evil", data=body,
                                  method="POST", headers={"Content-Type": "image/jpeg"})
    with urllib.request.urlopen(post, timeout=30) as resp:
        assert resp.status == 204


VIEW = b"GET /api/jobs/run/mirror HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Reader(threading.Thread):
    """A viewer that reads all it is sent, as fast as it comes: the frames it saw (their
    markers, `frame-NNN`)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        # (Connection: close, so the end of the stream is the end of the connection.)
        self.sock.sendall(VIEW.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        self.seen: set[int] = set()

    def run(self) -> None:
        tail = b""
        try:
            while chunk := self.sock.recv(MIB):
                data = tail + chunk
                self.seen.update(int(n) for n in re.findall(rb"frame-(\d{3})", data))
                tail = data[-16:]
        except OSError:
            pass  # the test ended it


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_viewers_that_never_read_hold_no_more_than_the_budget(process, loop):
    """The attack of review 20: claim your own host job; then, again and again, post a new
    1 MiB frame and open a viewer with a 4 KiB receive buffer that never reads. Each such
    viewer kept its own frame queued in its connection for the write-stall time (60 s), counted
    nowhere: 150 of them took a collector from 52 to 205 MB while `mirror_held_bytes` said
    1 MiB. Now a frame queued for a viewer is held, and counted, until the viewer has taken all
    of it; past the budget the viewers furthest behind are cut. A viewer that reads still gets
    the newest frame."""
    rounds, budget = 40, 4 * MIB
    proc = process(loop, {"FLEET_MAX_MIRROR_HELD_BYTES": str(budget),
                          "FLEET_WRITE_STALL_S": "300"})  # no viewer is cut for stalling here
    client = proc.client
    assert client.post("/jobs", job("run", workload="soak", executor="host",
                                    params={"app_id": "com.example"}))[0] == 201
    assert client.get("/executor/next-job?name=evil")[0] == 200
    post_frame_to(proc, jpeg(b"warm-up", MIB))
    reader = Reader(proc.port)
    reader.start()
    assert wait_until(lambda: client.get("/api/jobs/run/mirror/status")[1]["viewers"] == 1, 10)
    before = status_kib(proc.proc.pid, "VmHWM")  # a frame's upload and its relay already counted

    stalled, held = [], []
    for i in range(rounds):
        post_frame_to(proc, jpeg(b"frame-%03d" % i, MIB))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", proc.port))
        sock.sendall(VIEW)
        stalled.append(sock)
        held.append(client.get("/api/health")[1]["mirror_held_bytes"])

    grown = status_kib(proc.proc.pid, "VmHWM") - before
    # Without the bound each stalled viewer held nearly all of its 1 MiB frame: 40 MiB here.
    assert grown < 16 * 1024, f"peak RSS grew {grown} KiB with {rounds} stalled viewers"
    assert max(held) <= budget, held
    # Most stalled viewers were cut. Those left are the few whose frames the budget holds, and
    # the last few, whose connections' kernel send queues (up to tcp_wmem's 4 MiB, outside the
    # process) took all they were sent: they hold nothing in the collector until the next frame.
    assert wait_until(lambda: client.get("/api/jobs/run/mirror/status")[1]["viewers"]
                      < rounds // 2, 10), client.get("/api/jobs/run/mirror/status")
    assert wait_until(lambda: rounds - 1 in reader.seen, 20), sorted(reader.seen)
    assert reader.is_alive()  # the reading viewer was never cut
    assert client.post("/api/jobs/run/cancel")[0] == 200
    reader.join(20)
    assert not reader.is_alive()  # its stream ended with the job
    for sock in stalled:
        sock.close()
    assert "cut a live-mirror viewer of job run" in proc.log()
    assert "Traceback" not in proc.log()
