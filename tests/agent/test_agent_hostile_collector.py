"""The real agent process against a hostile collector: a scripted local HTTP server that answers
polls, beacons, result rows and uploads the way a broken, misconfigured or malicious server
might (nested JSON, absurd numbers, redirects, instant or endless or trickling answers, forged
log lines). Whatever it answers, the agent keeps its threads, ends each job with a final row,
keeps undelivered rows spooled in order, bounds its memory and its polls, and never touches a
directory outside its state directory."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.agent import AGENT_FILE, REPO, wait_for

pytestmark = pytest.mark.slow

DEEP = b"[" * 100_000 + b"]" * 100_000
SELF_CHECK = {"schema": 1, "job_id": "j1", "workload": "self-check", "executor": "device",
              "attempt": 1, "lease": {"ttl_s": 60}, "params": {}}
# Long enough to be running when the collector acts (about 0.25 s an iteration, 2000 of them).
BENCH = {"schema": 1, "job_id": "b1", "workload": "benchmark", "executor": "device",
         "backend": "synthetic", "attempt": 1, "lease": {"ttl_s": 2},
         "params": {"prompt_tokens": 64, "gen_tokens": 16, "warmup_iters": 0,
                    "measure_iters": 2000}}
# A route answers (status, body) or (status, body, headers), or None for the default answer,
# or HANDLED after writing the answer itself.
HANDLED = object()
Route = Callable[["Handler", str, str, bytes], object]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, *args: object) -> None:
        pass

    def send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.handle_request("GET", b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.handle_request("POST", self.rfile.read(length) if length else b"")

    def handle_request(self, method: str, body: bytes) -> None:
        fake = self.server.fake
        fake.record(method, self.path, body)
        answer = fake.route(self, method, self.path, body) if fake.route else None
        if answer is HANDLED:
            return
        if answer is None:
            answer = fake.default(method, self.path, body)
        self.send(*answer)  # type: ignore[misc]


class Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeCollector


class FakeCollector:
    """A well-behaved collector unless `route` says otherwise: registers, holds each poll a
    moment and answers 204, accepts result rows (recorded in `accepted`) and uploads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[float, str, str, object]] = []
        self.accepted: list[dict] = []
        self.route: Route | None = None
        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.fake = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def record(self, method: str, path: str, body: bytes) -> None:
        try:
            parsed: object = json.loads(body) if body else None
        except ValueError:
            parsed = body
        with self.lock:
            self.requests.append((time.monotonic(), method, path, parsed))

    def default(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path.endswith("/next-job"):
            time.sleep(0.3)
            return 204, b""
        if path == "/devices/register":
            return 200, b'{"ok": true}'
        if method == "POST" and path == "/results":
            items = json.loads(body)
            for item in items if isinstance(items, list) else [items]:
                if item.get("kind") == "result":
                    with self.lock:
                        self.accepted.append(item)
            return 200, b'{"ok": true, "lease_renewed": true}'
        if method == "POST" and path == "/artifacts":
            return 200, json.dumps({"sha256": hashlib.sha256(body).hexdigest()}).encode()
        return 404, b'{"error": "no such route"}'

    def polls(self, since: float = 0.0) -> int:
        with self.lock:
            return sum(1 for t, _, path, _ in self.requests
                       if path.endswith("/next-job") and t >= since)

    def job_beacons(self) -> int:
        with self.lock:
            return sum(1 for _, _, path, body in self.requests if path == "/results"
                       and isinstance(body, dict) and body.get("kind") == "beacon"
                       and body.get("job_id"))

    def finals(self) -> list[dict]:
        with self.lock:
            return [row for row in self.accepted if row.get("final")]


def is_result_post(method: str, path: str, body: bytes) -> bool:
    return method == "POST" and path == "/results" and b'"kind": "result"' in body


def one_job(spec: dict | bytes) -> Route:
    """Offer `spec` to the first poll; the rest get the default answer."""
    given = threading.Event()

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path.endswith("/next-job") and not given.is_set():
            given.set()
            return 200, spec if isinstance(spec, bytes) else json.dumps(spec).encode()
        return None

    return route


@pytest.fixture
def fake():
    collector = FakeCollector()
    yield collector
    collector.close()


def dead_threads(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("Exception in thread")]


# --- 1. deeply nested JSON -------------------------------------------------------------------


def test_a_deeply_nested_answer_to_a_poll_is_a_bad_answer_and_polling_goes_on(procs, fake):
    bad = [0]
    job = one_job(SELF_CHECK)

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path.endswith("/next-job") and bad[0] < 3:
            bad[0] += 1
            return 200, DEEP
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], "deep-poll")
    wait_for(fake.finals, 30, what="the job offered after three nested answers")
    assert fake.finals()[0]["ok"] is True
    log = agent.log()
    assert not dead_threads(log), log[-3000:]
    told = [line for line in log.splitlines()
            if "not usable JSON (RecursionError)" in line and " DEBUG " not in line]
    assert len(told) == 1 and " WARNING " in told[0], log[-3000:]


def test_a_deeply_nested_answer_to_a_beacon_does_not_end_the_lease_keeper(procs, fake):
    job = one_job(BENCH)
    stop = threading.Event()

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if method == "POST" and path == "/results" and b'"job_id"' in body \
                and b'"kind": "beacon"' in body:
            if stop.is_set():
                return 200, b'{"lease_renewed": false}'
            return 200, DEEP
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], "deep-beacon")
    # The lease keeper beacons every 0.5 s (a quarter of the 2 s lease); it keeps going after
    # the nested answers, and so still hears the collector stop the job.
    wait_for(lambda: fake.job_beacons() >= 4, 30, what="beacons after nested answers")
    stop.set()
    wait_for(fake.finals, 30, what="the job stopped by a later beacon's answer")
    assert "no longer renews" in fake.finals()[0]["error"]
    assert not dead_threads(agent.log()), agent.log()[-3000:]


# --- 2. a lease TTL no float holds -------------------------------------------------------------


def test_a_huge_lease_ttl_means_the_default_and_the_job_ends_with_a_final_row(procs, fake):
    raw = json.dumps(SELF_CHECK).replace('"ttl_s": 60', '"ttl_s": 1' + "0" * 400).encode()
    fake.route = one_job(raw)
    agent = procs.agent([fake.url], "huge-ttl")
    wait_for(fake.finals, 30, what="the final row of a job with a huge ttl_s")
    assert fake.finals()[0]["ok"] is True, fake.finals()
    since = time.monotonic()
    wait_for(lambda: fake.polls(since) >= 2, 15, what="polls after the job")
    assert not dead_threads(agent.log()), agent.log()[-3000:]


# --- 3. a hand-back whose progress upload gets a non-JSON answer ---------------------------


def test_a_hand_back_with_a_non_json_upload_answer_still_posts_the_preempted_row(procs, fake):
    job = one_job(dict(BENCH, preemptible=True))

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if method == "POST" and path == "/artifacts":
            return 200, b"<html>ok</html>"
        if method == "POST" and path == "/results" and b'"job_id"' in body \
                and b'"kind": "beacon"' in body:
            return 200, b'{"lease_renewed": true, "preempt": true}'
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], "bad-upload")
    wait_for(fake.finals, 30, what="the preempted final row")
    row = fake.finals()[0]
    assert row["preempted"] is True and row["ok"] is False, row
    assert row["iter"] == 999_999 and row["artifacts"] == []
    assert "progress could not be uploaded" in row["error"]
    assert not dead_threads(agent.log()), agent.log()[-3000:]


# --- 4. redirects ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [302, 307, 308])
def test_a_redirected_row_stays_spooled_and_reaches_the_collector_later(procs, fake, status):
    job = one_job(SELF_CHECK)
    moved = threading.Event()
    moved.set()
    location = fake.url + "/elsewhere"

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path == "/elsewhere":
            return 200, b'{"ok": true}'
        if moved.is_set() and is_result_post(method, path, body):
            return status, b"", {"location": location}
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], f"redirect-{status}")
    tries = lambda: sum(1 for _, m, p, b in list(fake.requests)  # noqa: E731
                        if m == "POST" and p == "/results" and isinstance(b, (dict, list))
                        and "result" in json.dumps(b))
    wait_for(lambda: tries() >= 1, 30, what="the row's first post")
    # The row is posted again and again (with backoff), unless it was taken as delivered.
    wait_for(lambda: tries() >= 3 or not agent.spooled(), 30, what="more posts of the row")
    assert len(agent.spooled()) == 1, "a redirected row was counted as delivered"
    assert fake.accepted == []
    assert not [r for r in fake.requests if r[2] == "/elsewhere"], "a redirect was followed"
    said = [line for line in agent.log().splitlines()
            if f"answered {status}, a redirect to {location}" in line and " ERROR " in line]
    assert len(said) == 1, agent.log()[-3000:]

    moved.clear()
    wait_for(fake.finals, 30, what="the spooled row, once the collector takes it")
    assert fake.finals()[0]["job_id"] == "j1"
    wait_for(lambda: not agent.spooled(), 10, what="an empty spool")


# --- 5. a collector that answers polls at once --------------------------------------------------


@pytest.mark.parametrize("answer", [(204, b""), (200, b"null")], ids=["204", "200-null"])
def test_instant_empty_answers_to_polls_are_polled_about_once_a_second(procs, fake, answer):
    fake.route = lambda handler, method, path, body: (
        answer if path.endswith("/next-job") else None)
    agent = procs.agent([fake.url], "instant")
    wait_for(lambda: fake.polls() >= 1, 30, what="the first poll")
    since = time.monotonic()
    time.sleep(3)
    polls = fake.polls(since)
    # The floor is 1 s: about 3 polls; without it, thousands.
    assert 1 <= polls <= 10, polls
    assert agent.proc is not None and agent.proc.poll() is None


# --- 6. endless and trickling answers -----------------------------------------------------------


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (or another /proc status figure, such as its peak
    VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def chunked_forever(handler: Handler, first: bytes, piece: bytes, pause: float) -> object:
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("transfer-encoding", "chunked")
    handler.end_headers()
    framed = b"%x\r\n" % len(piece) + piece + b"\r\n"
    with contextlib.suppress(OSError):
        handler.wfile.write(b"%x\r\n" % len(first) + first + b"\r\n")
        handler.wfile.flush()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            handler.wfile.write(framed)
            handler.wfile.flush()
            if pause:
                time.sleep(pause)
    handler.close_connection = True
    return HANDLED


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_endless_answer_is_cut_off_and_memory_stays_bounded(procs, fake):
    fake.route = lambda handler, method, path, body: (
        chunked_forever(handler, b"[", b" " * (1 << 20), 0) if path.endswith("/next-job")
        else None)
    agent = procs.agent([fake.url], "flood")
    assert agent.proc is not None
    wait_for(lambda: fake.polls() >= 1, 30, what="the first poll")
    peak = 0.0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline and peak < 300:
        peak = max(peak, rss_mb(agent.proc.pid))
        time.sleep(0.05)
    assert peak < 300, f"the agent grew to {peak:.0f} MB on an endless answer"
    wait_for(lambda: fake.polls() >= 3, 30, what="polls after answers that were cut off")
    assert "more than the 2097152 bytes an answer may have" in agent.log()  # a job's bound


# `{},` is four bytes and a dict of its own once parsed: about thirty times its size in memory.
EMPTIES = b"[" + b"{}," * ((8 << 20) // 3 - 1) + b"{}]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_answers_that_parse_to_millions_of_objects_are_refused_by_their_size(procs, fake):
    """A lying collector answered beacons, rows and polls with 8 MiB of empty objects, the
    most memory a byte of JSON can ask for: each answer parsed took the agent past 260 MB (a
    job's beacon and its rows at once, past 500 MB). An acknowledgement is read to 256 KiB and
    a job offered to 2 MiB, so rows stay spooled and polling goes on."""
    fake.route = lambda handler, method, path, body: (
        (200, EMPTIES) if method == "POST" and path == "/results" else None)
    agent = procs.agent([fake.url], "empties")
    assert agent.proc is not None
    wait_for(lambda: "more than the 262144 an answer may have" in agent.log(), 60,
             what="a beacon's answer refused by its size")
    # A beacon answered unusably is a collector out of reach: polls wait until it answers.
    fake.route = lambda handler, method, path, body: (
        (200, EMPTIES) if path.endswith("/next-job") else None)
    wait_for(lambda: fake.polls() >= 3, 60, what="polls answered with 8 MiB")
    assert "more than the 2097152 an answer may have" in agent.log()
    peak = rss_mb(agent.proc.pid, "VmHWM")
    assert peak < 150, peak
    assert not dead_threads(agent.log())


def test_a_job_whose_id_breaks_the_id_rule_is_not_run_and_spools_nothing(procs, fake):
    """Every row names its job, and a final row is spooled past the spool's bound rather than
    lost: an 8 MB job id from a collector that refused rows made 16 MB spool files, a
    gigabyte in minutes. The collector keeps to its id rule, so an id that breaks it is not
    a job the agent runs."""
    offered = one_job(dict(SELF_CHECK, job_id="x" * 201))
    fake.route = lambda handler, method, path, body: (
        (503, b"{}") if method == "POST" and path == "/results" and b'"result"' in body
        else offered(handler, method, path, body))
    agent = procs.agent([fake.url], "long-id")
    wait_for(lambda: "breaks the collector's id rule; ignored" in agent.log(), 30,
             what="the job refused")
    wait_for(lambda: fake.polls() >= 3, 30, what="polls after the refusal")
    assert " started: " not in agent.log() and not agent.spooled()


def test_a_trickling_answer_is_given_up_at_the_deadline_and_polling_goes_on(procs, fake):
    # A byte every 0.3 s: no socket read ever waits the 2 s timeout, so only an overall
    # deadline ends the poll.
    fake.route = lambda handler, method, path, body: (
        chunked_forever(handler, b"{", b" ", 0.3) if path.endswith("/next-job") else None)
    agent = procs.agent([fake.url], "trickle", "--poll-timeout-s", "2")
    wait_for(lambda: fake.polls() >= 3, 30, what="polls after trickling answers")
    assert "next-job took longer than 2 s" in agent.log(), agent.log()[-3000:]


# --- 7. spool order across a clock stepped back ---------------------------------------------


def test_rows_spooled_after_a_newer_name_are_named_after_it_and_delivered_after_it(procs, fake,
                                                                                tmp_path):
    """A row spooled before the wall clock stepped back an hour has a name an hour ahead of
    now. The agent's next rows must still sort (and so be posted) after it."""
    spool = tmp_path / "state-clock" / "spool"
    spool.mkdir(parents=True)
    ahead = time.time_ns() + 3600 * 10**9
    planted = spool / f"{ahead:020d}-000001.json"
    earlier = {"schema": 1, "kind": "result", "device_id": "clock", "job_id": "earlier",
               "iter": 1, "ok": True, "final": False, "metrics": {}}
    planted.write_text(json.dumps({"collector": fake.url, "row": earlier}))
    job = one_job(SELF_CHECK)
    down = threading.Event()
    down.set()

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if down.is_set() and is_result_post(method, path, body):
            return 503, b'{"error": "down for a moment"}'
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], "clock")
    wait_for(lambda: len(agent.spooled()) == 2, 30, what="the job's row spooled")
    names = [p.name for p in agent.spooled()]
    assert names[0] == planted.name, names
    assert names[1] > planted.name
    down.clear()
    wait_for(lambda: len(fake.accepted) == 2, 30, what="both rows delivered")
    assert [r["job_id"] for r in fake.accepted] == ["earlier", "j1"], fake.accepted


# --- 8. ids that would name a directory outside the state directory ---------------------------


@pytest.mark.parametrize("how", ["--device-id", "--name", "state.json"])
def test_an_id_that_escapes_the_state_directory_is_refused_and_nothing_outside_is_touched(
        tmp_path, how):
    state = tmp_path / "state"
    (state / "work").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    argv = [sys.executable, str(AGENT_FILE), "--collector", "http://127.0.0.1:9",
            "--state-dir", str(state), "--print-descriptor"]
    if how == "--device-id":
        argv += ["--device-id", "../../victim"]
    elif how == "--name":
        argv += ["--executor", "host", "--name", "../victim"]
    else:
        (state / "state.json").write_text(json.dumps({"device_id": "../../victim"}))
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (victim / "precious.txt").read_text() == "keep me"
    assert done.returncode == 1, done
    source = "state.json" if how == "state.json" else how
    assert re.search(rf"fleet_agent: refusing the id '\.\./(\.\./)?victim' from \S*{source}: "
                     r"it may not contain / or \\ or be '\.' or '\.\.', as it names a "
                     "directory in the state directory", done.stderr), done.stderr


# --- 9. collector text in log lines -------------------------------------------------------------


def test_a_job_id_with_a_newline_cannot_forge_a_log_line(procs, fake):
    forged = "2026-01-01 00:00:00,000 ERROR collector says: run rm -rf ~ now"
    fake.route = one_job(dict(SELF_CHECK, job_id="x\n" + forged + "\x1b[2J"))
    agent = procs.agent([fake.url], "forge")
    wait_for(lambda: "breaks the collector's id rule" in agent.log(), 30,
             what="the job refused")
    lines = agent.log().splitlines()
    assert not [line for line in lines if line.startswith(forged)], agent.log()[-3000:]
    assert "\x1b" not in agent.log()
    refused = [line for line in lines if "breaks the collector's id rule" in line]
    assert refused and ("job_id x\\n" + forged[:40]) in refused[0], refused
    assert not fake.finals()


# --- 10. directory modes -----------------------------------------------------------------------


def test_every_directory_the_agent_makes_in_its_state_directory_is_private(procs, fake,
                                                                          tmp_path):
    old = os.umask(0o022)
    try:
        agent = procs.agent([fake.url], "modes")
    finally:
        os.umask(old)
    wait_for(lambda: fake.polls() >= 1, 30, what="the first poll")
    dirs = [agent.state, *(p for p in agent.state.rglob("*") if p.is_dir())]
    names = {str(p.relative_to(agent.state)) for p in dirs}
    assert {".", "spool", "spool/rejected", "cache", "work", "work/modes"} <= names, names
    loose = {str(p.relative_to(agent.state)): oct(stat.S_IMODE(p.stat().st_mode))
             for p in dirs if stat.S_IMODE(p.stat().st_mode) != 0o700}
    assert not loose, loose


# --- 11. jobs offered back to back whose rows are refused ------------------------------------


@pytest.mark.parametrize("status", [400, 503], ids=["refused", "down"])
def test_jobs_whose_rows_are_refused_are_claimed_with_backoff(procs, fake, status):
    offered = itertools.count(1)

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path.endswith("/next-job"):  # a new job at once, every time: one the agent refuses
            spec = dict(SELF_CHECK, job_id=f"n{next(offered)}", workload="nope")
            return 200, json.dumps(spec).encode()
        if is_result_post(method, path, body):
            return status, b'{"error": "not now"}'
        return None

    fake.route = route
    agent = procs.agent([fake.url], "refused")
    wait_for(lambda: fake.polls() >= 1, 30, what="the first claim")
    since = time.monotonic()
    time.sleep(4)
    claims = fake.polls(since)
    # The claims wait out the backoff (--retry-base-s 0.2 doubling to --retry-cap-s 1): about
    # 7 in 4 s. Without it, hundreds, each leaving a row on disk and an ERROR line.
    assert 2 <= claims <= 15, claims
    kept = agent.state / "spool" / ("rejected" if status == 400 else "")
    assert 1 <= len(list(kept.glob("*.json"))) <= 20
    assert agent.proc is not None and agent.proc.poll() is None


# --- 12. a job's page that never finishes, and a shutdown -------------------------------------


def test_sigterm_stops_a_vantage_job_on_a_trickling_page_and_its_final_row_is_posted(
        procs, fake, trickle):
    page = trickle(0.5)
    fake.route = one_job(dict(SELF_CHECK, job_id="v1", workload="vantage",
                              params={"urls": [page.url + "/"], "repeats": 1,
                                      "timeout_s": 120}))
    agent = procs.agent([fake.url], "trickled", "--allow-private-urls")
    wait_for(lambda: page.requests >= 1, 30, what="the measurement to start")
    started = time.monotonic()
    assert agent.stop() == 0
    assert time.monotonic() - started < 5
    row = fake.finals()[0]
    assert row["job_id"] == "v1" and row["preempted"] is True, row
    assert "the agent is shutting down; the job was handed back" in row["error"]


# --- 13. a spooled row nested deeper than the parser reads ------------------------------------


def spool_row(spool, number: int, text: str) -> None:
    spool.mkdir(parents=True, exist_ok=True)
    (spool / f"{time.time_ns() + number:020d}-{number:06d}.json").write_text(text)


def test_a_spooled_row_nested_too_deep_to_read_is_set_aside_and_the_rest_are_delivered(
        procs, fake, tmp_path):
    """A pipeline event's `source` lands in a row as the collector sent it; nested a little
    deeper than the decoder reaches from where the outbox reads, the row is written but cannot
    be read back. It is set aside like any other unreadable entry, and the rows behind it go."""
    spool = tmp_path / "state-deep-spool" / "spool"
    spool_row(spool, 1, f'{{"collector": "{fake.url}", "row": {DEEP.decode()}}}')
    later = {"schema": 1, "kind": "result", "device_id": "deep-spool", "job_id": "after",
             "iter": 1, "ok": True, "final": True, "metrics": {}}
    spool_row(spool, 2, json.dumps({"collector": fake.url, "row": later}))
    agent = procs.agent([fake.url], "deep-spool")
    wait_for(fake.finals, 30, what="the row spooled behind the nested one")
    assert [r["job_id"] for r in fake.accepted] == ["after"]
    wait_for(lambda: list((spool / "rejected").glob("*-000001.json")), 10,
             what="the nested row set aside")
    # The fake records the row before the agent reads the answer and removes the entry.
    wait_for(lambda: not agent.spooled(), 10, what="the delivered row's entry removed")
    assert not dead_threads(agent.log()), agent.log()[-3000:]


def test_a_huge_event_source_reaches_no_row_and_the_spool_stays_small(procs, fake, tmp_path):
    """A pipeline whose collector hands it events with a 4 MB `source` and refuses its rows
    for a while (503): each row carries the source cut to the 200 characters a collector
    keeps, so the spool holds a few KB, and every row is delivered once rows are taken."""
    source = "s" * 4_000_000
    refusing = threading.Event()
    refusing.set()
    seq = itertools.count(1)
    job = one_job({"schema": 1, "job_id": "pipe", "workload": "pipeline", "executor": "device",
                   "backend": "synthetic", "attempt": 1, "lease": {"ttl_s": 60},
                   "params": {"topic": "t", "max_events": 12, "max_tokens": 4}})

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path.startswith("/api/events/t/next"):
            time.sleep(0.05)
            return 200, json.dumps({"events": [{"seq": next(seq), "payload": "go",
                                                "source": source}]}).encode()
        if path.startswith("/api/events/t"):
            return 200, b'{"last_seq": 0}'
        if refusing.is_set() and is_result_post(method, path, body):
            return 503, b'{"error": "busy"}'
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], "pipe-dev")
    spool = tmp_path / "state-pipe-dev" / "spool"
    wait_for(lambda: len(list(spool.glob("*.json"))) >= 12, 60, what="the refused rows spooled")
    assert max(p.stat().st_size for p in spool.glob("*.json")) < 16_000
    refusing.clear()
    wait_for(fake.finals, 60, what="the pipeline's final row")
    rows = [r for r in fake.accepted if r["job_id"] == "pipe" and not r.get("final")]
    assert sorted(r["seq"] for r in rows) == list(range(1, 13))
    assert {r["source"] for r in rows} == {"s" * 197 + "..."}
    assert fake.finals()[0]["ok"] is True, fake.finals()
    assert not dead_threads(agent.log()), agent.log()[-3000:]


def test_the_outbox_thread_outlives_a_failure_and_delivers_once_it_clears(procs, fake):
    """spool/rejected/ turned into a file while the agent runs: setting an entry aside fails
    (not a directory). The thread that re-posts spooled rows says so and tries again later;
    once the directory is back, the entry is set aside and the row behind it is delivered."""
    agent = procs.agent([fake.url], "flusher")
    wait_for(lambda: any(p == "/devices/register" for _, _, p, _ in list(fake.requests)), 30,
             what="registration")
    rejected = agent.state / "spool" / "rejected"
    rejected.rmdir()
    rejected.write_text("not a directory")
    spool_row(agent.state / "spool", 1, "{}")  # no row: to be set aside
    row = {"schema": 1, "kind": "result", "device_id": "flusher", "job_id": "behind",
           "iter": 1, "ok": True, "final": True, "metrics": {}}
    spool_row(agent.state / "spool", 2, json.dumps({"collector": fake.url, "row": row}))
    wait_for(lambda: "NotADirectoryError" in agent.log(), 30, what="the failed set-aside")
    rejected.unlink()
    rejected.mkdir(mode=0o700)
    wait_for(fake.finals, 30, what="the row behind the entry, delivered by the outbox thread")
    assert [r["job_id"] for r in fake.accepted] == ["behind"]
    assert list(rejected.glob("*-000001.json"))
    assert not dead_threads(agent.log()), agent.log()[-3000:]
    assert "re-posting spooled rows failed unexpectedly" in agent.log()


# --- 14. progress too large to parse safely ---------------------------------------------------


def test_resume_from_progress_over_the_cap_is_refused_before_it_is_read(procs, fake):
    """Parsed JSON can take 25 times its bytes (a file of empty arrays): progress one byte over
    the 16 MiB cap is refused by its declared size, before a byte of it is downloaded, so it is
    never parsed (at the old 64 MiB cap such a file took 1.7 GB of memory)."""
    cap = 16 << 20
    body = b"[" + b"[]," * ((cap - 3) // 3) + b"[]]"
    body += b" " * (cap + 1 - len(body))
    sha = hashlib.sha256(body).hexdigest()
    job = one_job(dict(BENCH, job_id="r1", attempt=2, params=dict(
        BENCH["params"], measure_iters=3, resume_from=sha)))

    def route(handler: Handler, method: str, path: str, data: bytes) -> object:
        if path == "/artifacts/" + sha:
            return 200, body
        return job(handler, method, path, data)

    fake.route = route
    agent = procs.agent([fake.url], "big-progress")
    wait_for(fake.finals, 30, what="the job's final row")
    row = fake.finals()[0]
    assert row["ok"] is False
    assert row["error"] == (f"params.resume_from: artifact {sha[:12]} could not be downloaded: "
                            f"it is larger than the {cap} bytes the agent takes"), row
    assert not list((agent.state / "cache").iterdir())


# --- 15. an artifact that trickles in ---------------------------------------------------------


class Trickled:
    """An artifact answer that declares 10 MiB and sends 8 KiB every 0.1 s: each 1 MiB comes
    well inside the 300 s a chunk may take, so only the job's stop can end the download."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.hung_up = threading.Event()
        self.closing = threading.Event()

    def send(self, handler: Handler) -> object:
        handler.send_response(200)
        handler.send_header("content-type", "application/octet-stream")
        handler.send_header("content-length", str(10 << 20))
        handler.end_headers()
        self.started.set()
        try:
            for _ in range(1200):  # two minutes at most, whatever the agent does
                handler.wfile.write(b"x" * 8192)
                handler.wfile.flush()
                if self.closing.wait(0.1):
                    break
        except OSError:
            self.hung_up.set()
        handler.close_connection = True
        return HANDLED


def trickling_batch(fake: FakeCollector, lease: dict) -> Trickled:
    artifact = Trickled()
    job = one_job(dict(SELF_CHECK, job_id="dl", workload="batch", backend="synthetic",
                       params={"input_sha256": "ab" * 32}))

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path == "/artifacts/" + "ab" * 32:
            return artifact.send(handler)
        if method == "POST" and path == "/results" and b'"job_id"' in body \
                and b'"kind": "beacon"' in body:
            return 200, json.dumps(lease).encode()
        return job(handler, method, path, body)

    fake.route = route
    return artifact


@pytest.fixture
def closing():
    made: list[Trickled] = []
    yield made
    for artifact in made:
        artifact.closing.set()


@pytest.mark.parametrize("how, says", [
    ("ceiling", "stopped: the job ran for the 2 s this agent allows a job (its owner's "
                "--max-job-seconds)"),
    ("lease", "stopped: the collector no longer renews this job's lease"),
])
def test_a_trickling_download_ends_with_its_job(procs, fake, closing, how, says):
    renewed = how != "lease"
    artifact = trickling_batch(fake, {"lease_renewed": renewed})
    closing.append(artifact)
    extra = ("--max-job-seconds", "2") if how == "ceiling" else ()
    agent = procs.agent([fake.url], "trickled-dl", *extra)
    assert artifact.started.wait(30), agent.log()[-3000:]
    wait_for(fake.finals, 30, what="the final row of the job stopped mid-download")
    row = fake.finals()[0]
    assert row["ok"] is False and row["error"].startswith(says), row
    assert "could not be downloaded" not in row["error"]
    assert artifact.hung_up.wait(30), "the download went on after its job ended"
    assert not list((agent.state / "cache").iterdir())  # no partial .dl-* file left
    assert not dead_threads(agent.log()), agent.log()[-3000:]


def test_sigterm_ends_a_trickling_download_and_the_job_is_handed_back(procs, fake, closing):
    artifact = trickling_batch(fake, {"lease_renewed": True})
    closing.append(artifact)
    agent = procs.agent([fake.url], "trickled-term", "--grace-s", "10")
    assert artifact.started.wait(30), agent.log()[-3000:]
    assert agent.stop(30) == 0
    # Within the grace the job stopped, handed back, and posted its final row.
    row = fake.finals()[0]
    assert row["job_id"] == "dl" and row["preempted"] is True, row
    assert "the agent is shutting down; the job was handed back" in row["error"]
    assert artifact.hung_up.wait(30)
    assert not list((agent.state / "cache").iterdir())


@pytest.mark.parametrize("how, says", [
    ("ceiling", "stopped: the job ran for the 3 s this agent allows a job (its owner's "
                "--max-job-seconds)"),
    ("lease", "stopped: the collector no longer renews this job's lease"),
])
def test_an_upload_never_answered_ends_with_its_job(procs, fake, how, says):
    """A collector that reads an upload's body and never answers: the upload's deadline (600 s
    and more, three tries) held a cancelled job, or one past its ceiling, and its device."""
    data = b'"hello"\n'
    sha = hashlib.sha256(data).hexdigest()
    spec = dict(SELF_CHECK, job_id="up", workload="batch", backend="synthetic",
                params={"input_sha256": sha})
    job = one_job(spec)
    uploading, closing, hung_up = threading.Event(), threading.Event(), threading.Event()

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path == "/artifacts/" + sha:
            return 200, data
        if method == "POST" and path == "/artifacts":
            uploading.set()
            with contextlib.suppress(OSError):
                while not closing.is_set() and handler.rfile.read(1):
                    pass  # the body is read; no answer until the agent hangs up
            hung_up.set()
            return HANDLED
        if how == "lease" and uploading.is_set() and method == "POST" and path == "/results" \
                and b'"kind": "beacon"' in body and b'"job_id": "up"' in body:
            return 200, b'{"lease_renewed": false}'
        return job(handler, method, path, body)

    fake.route = route
    extra = ("--max-job-seconds", "3") if how == "ceiling" else ()
    try:
        agent = procs.agent([fake.url], "hung-upload", *extra)
        assert uploading.wait(30), agent.log()[-3000:]
        wait_for(fake.finals, 30, what="the final row of the job stopped mid-upload")
        row = fake.finals()[0]
        assert row["ok"] is False and row["error"].startswith(says), row
        assert hung_up.wait(30), "the upload went on after its job ended"
        assert not dead_threads(agent.log()), agent.log()[-3000:]
    finally:
        closing.set()


# --- 16. artifacts larger than their use takes ------------------------------------------------


def declared_only(handler: Handler, size: int) -> object:
    """An answer that declares `size` bytes and sends none of them."""
    handler.send_response(200)
    handler.send_header("content-type", "application/octet-stream")
    handler.send_header("content-length", str(size))
    handler.end_headers()
    handler.wfile.flush()
    handler.close_connection = True
    with contextlib.suppress(OSError):
        handler.rfile.read(1)  # until the agent hangs up (or the test ends the server)
    return HANDLED


@pytest.mark.parametrize("use", ["batch input", "vision image"])
def test_an_artifact_larger_than_its_use_takes_is_refused_before_its_first_byte(procs, fake,
                                                                                 use):
    """A JSON Lines input is read up to 16 MiB and an eval item's image up to 1 GiB: a
    collector naming a larger blob for them has it refused by its declared size, instead of
    written to the disk (up to 128 GiB, the bound for models) before anything reads it."""
    big = "ab" * 32
    if use == "batch input":
        limit = 16 << 20
        spec = dict(SELF_CHECK, job_id="big", workload="batch", backend="synthetic",
                    params={"input_sha256": big})
    else:
        limit = 1 << 30
        dataset = json.dumps({"image_sha256": big, "label": "cat"}).encode() + b"\n"
        spec = dict(SELF_CHECK, job_id="big", workload="vision-eval", backend="synthetic",
                    params={"input_sha256": hashlib.sha256(dataset).hexdigest()})
    job = one_job(spec)

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        if path == "/artifacts/" + big:
            return declared_only(handler, limit + 1)
        if use == "vision image" and path == "/artifacts/" + spec["params"]["input_sha256"]:
            return 200, dataset
        return job(handler, method, path, body)

    fake.route = route
    agent = procs.agent([fake.url], "too-big")
    wait_for(fake.finals, 30, what="the job's final row")
    row = fake.finals()[0]
    assert row["ok"] is False
    assert row["error"] == (f"artifact {big[:12]} could not be downloaded: it is larger than "
                            f"the {limit} bytes the agent takes"), row
    assert not [p for p in (agent.state / "cache").iterdir() if p.name.startswith(big)]


# --- 17. a cache that would grow for good -----------------------------------------------------


CACHE_BOUND = 8 * 10**9  # what the agent's cache keeps at most (--cache-max-gb 8)


def two_batch_inputs(fake) -> list[str]:
    """Two batch jobs, one after the other, each with an input of 6 MiB the fake serves; the
    inputs' hashes."""
    inputs = [json.dumps({"prompt": name}).encode() + b"\n" + b" " * (6 << 20) + b"\n"
              for name in ("first", "second")]
    shas = [hashlib.sha256(data).hexdigest() for data in inputs]
    blobs = dict(zip(shas, inputs, strict=True))
    offered = iter(dict(SELF_CHECK, job_id=f"in{n}", workload="batch", backend="synthetic",
                        params={"input_sha256": digest, "max_items": 1, "max_tokens": 1})
                   for n, digest in enumerate(shas))
    given = [0]

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        digest = path.rpartition("/")[2]
        if path.startswith("/artifacts/") and digest in blobs:
            return 200, blobs[digest]
        if path.endswith("/next-job") and len(fake.finals()) == given[0]:
            spec = next(offered, None)
            if spec is not None:
                given[0] += 1
                return 200, json.dumps(spec).encode()
        return None

    fake.route = route
    return shas


def test_the_cache_removes_the_least_recently_used_artifact_past_its_bound(procs, fake,
                                                                            tmp_path):
    """Each blob a collector names used to stay in cache/ for good. A cache already near its
    bound (an old model: a sparse file, so it takes no disk here) gets two inputs of 6 MiB:
    the second takes it past the bound, and the old model, the least recently used, goes; the
    inputs stay."""
    cache = tmp_path / "state-lru" / "cache"
    cache.mkdir(parents=True, mode=0o700)
    old = cache / ("cd" * 32 + ".gguf")
    with open(old, "wb") as fh:
        fh.truncate(CACHE_BOUND - (8 << 20))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    shas = two_batch_inputs(fake)
    agent = procs.agent([fake.url], "lru")
    wait_for(lambda: len(fake.finals()) == 2, 60, what="both jobs' final rows")
    assert [r["ok"] for r in fake.finals()] == [True, True], fake.finals()
    assert sorted(p.name for p in cache.iterdir()) == sorted(d + ".jsonl" for d in shas)
    assert f"removed cached artifact {old.name} ({CACHE_BOUND - (8 << 20)} bytes), the least " \
           "recently used" in agent.log()


def test_the_cache_ranks_by_last_use_across_a_restart(procs, fake, tmp_path):
    """Recency used to live in the agent's memory, so after a restart the cache removed the
    file downloaded first, however recently a job had used it. One run uses input A, then B,
    then A again; the next run's new input C takes the cache past its bound (16 MB, three
    inputs of 6 MiB), and B, the least recently used, goes."""
    data = {name: json.dumps({"prompt": name}).encode() + b"\n" + b" " * (6 << 20) + b"\n"
            for name in "ABC"}
    sha = {name: hashlib.sha256(blob).hexdigest() for name, blob in data.items()}
    blobs = {sha[name]: blob for name, blob in data.items()}
    order = ["A", "B", "A", "C"]
    given = [0]

    def route(handler: Handler, method: str, path: str, body: bytes) -> object:
        digest = path.rpartition("/")[2]
        if path.startswith("/artifacts/") and digest in blobs:
            return 200, blobs[digest]
        if path.endswith("/next-job") and len(fake.finals()) == given[0] < limit[0]:
            spec = dict(SELF_CHECK, job_id=f"use{given[0]}", workload="batch",
                        backend="synthetic", params={"input_sha256": sha[order[given[0]]],
                                                     "max_items": 1, "max_tokens": 1})
            given[0] += 1
            return 200, json.dumps(spec).encode()
        return None

    limit = [3]
    fake.route = route
    first = procs.agent([fake.url], "recency", "--cache-max-gb", "0.016")
    wait_for(lambda: len(fake.finals()) == 3, 60, what="the first run's three jobs")
    first.stop()
    cache = tmp_path / "state-recency" / "cache"
    assert sorted(p.name for p in cache.iterdir()) == sorted(sha[n] + ".jsonl" for n in "AB")
    limit[0] = 4
    second = procs.agent([fake.url], "recency", "--cache-max-gb", "0.016")
    wait_for(lambda: len(fake.finals()) == 4, 60, what="the second run's job")
    assert [r["ok"] for r in fake.finals()] == [True] * 4, fake.finals()
    assert sorted(p.name for p in cache.iterdir()) == sorted(sha[n] + ".jsonl" for n in "AC")
    assert f"removed cached artifact {sha['B']}.jsonl" in second.log()


def test_the_owner_sets_the_caches_bound(procs, fake, tmp_path):
    """--cache-max-gb (FLEET_AGENT_CACHE_MAX_GB) sets the bound: at 8 MB, the second of two
    6 MiB inputs takes the first's place once the first job is over."""
    shas = two_batch_inputs(fake)
    agent = procs.agent([fake.url], "bound", "--cache-max-gb", "0.008")
    wait_for(lambda: len(fake.finals()) == 2, 60, what="both jobs' final rows")
    assert [r["ok"] for r in fake.finals()] == [True, True], fake.finals()
    cache = tmp_path / "state-bound" / "cache"
    assert sorted(p.name for p in cache.iterdir()) == [shas[1] + ".jsonl"]
    assert "the cache keeps at most 8000000 bytes" in agent.log()


# --- 18. a hash with a newline after it -------------------------------------------------------


def test_a_hash_followed_by_a_newline_is_refused_as_no_hash(procs, fake):
    job = one_job(dict(SELF_CHECK, job_id="nl", workload="batch", backend="synthetic",
                       params={"input_sha256": "ab" * 32 + "\n"}))
    fake.route = job
    agent = procs.agent([fake.url], "newline-hash")
    wait_for(fake.finals, 30, what="the job's final row")
    row = fake.finals()[0]
    assert row["ok"] is False
    assert row["error"].startswith("params.input_sha256 must be the SHA-256 of an artifact (64 "
                                   "hex digits); the job gave"), row
    assert not [r for r in fake.requests if r[2].startswith("/artifacts/")]
    assert "failed unexpectedly" not in agent.log()
