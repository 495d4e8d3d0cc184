"""What the control plane reads from a runner's directory, when that directory is hostile.

A runner directory is written by the runner software, by the workflow jobs it runs (as the same
user) and perhaps by other local users, so any of its files may be a symlink, a FIFO, bytes that
are not UTF-8 or JSON of any shape. Each test plants one such file on the fake host and asks the
real app (in-process, over the fake systemctl and GitHub API): the daemon must start, serve the
other runners, keep what a file points at to itself and never serve a secret.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleet_min.controlplane.http.app import create_app
from fleet_min.controlplane.runners import bundle, diag
from tests.support.controlplane import Daemon, Host, auth, cp_of, make_config, until

SECRET = "Sup3rSecretValue9x"  # a value found by its key's name only (no vendor shape)
CREDENTIAL = "CREDENTIAL-MUST-NOT-LEAVE"

# A FIFO that nothing writes to made the first discovery wait forever in a thread (the daemon
# never started, and no signal reaches that thread): should that come back, the thread method
# ends the stuck run with a stack dump instead of hanging it.
pytestmark = pytest.mark.timeout(30, method="thread")


async def start(host: Host, aiohttp_client: Any) -> Any:
    """The app over the fake host as it is now (the first snapshot is built at start)."""
    return await aiohttp_client(create_app(make_config(host), dict(os.environ)))


@pytest.fixture
def host_env(host: Host, monkeypatch: pytest.MonkeyPatch) -> Host:
    """The fake host, its environment on this process (restored after the test)."""
    for key, value in host.env.items():
        monkeypatch.setenv(key, value)
    return host


async def runners(client: Any) -> dict[str, dict[str, Any]]:
    body = await (await client.get("/api/state")).json()
    return {r["name"]: r for r in body["runners"]}


# --- discovery: what it reads must not wedge, crash or leak ------------------------------------

async def test_a_drain_marker_linked_to_the_credentials_is_not_served(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    (path / ".credentials").write_text(json.dumps({"token": CREDENTIAL}))
    (path / ".fleet-drain").symlink_to(path / ".credentials")
    client = await start(host_env, aiohttp_client)
    body = await (await client.get("/api/state")).text()
    assert CREDENTIAL not in body
    view = (await runners(client))["r1"]
    assert view["draining"] is True and view["draining_since"] == "unknown"


async def test_a_drain_marker_that_is_not_a_time_is_not_served(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    (path / ".fleet-drain").write_text(f"password={SECRET}\n")
    client = await start(host_env, aiohttp_client)
    assert SECRET not in await (await client.get("/api/state")).text()
    assert (await runners(client))["r1"]["draining_since"] == "unknown"


async def test_drain_never_writes_through_a_dangling_marker_link(
        host_env: Host, tmp_path: Path, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    outside = tmp_path / "outside" / "planted"
    outside.parent.mkdir()
    (path / ".fleet-drain").symlink_to(outside)
    client = await start(host_env, aiohttp_client)
    resp = await client.post("/api/action", json={"id": "runner.drain", "args": {"name": "r1"}},
                             headers=auth(cp_of(client)))
    assert resp.status == 200
    assert not outside.exists()
    assert (path / ".fleet-drain").is_symlink()


@pytest.mark.parametrize("name", [".fleet-drain", ".service", ".runner"])
async def test_a_fifo_in_a_runner_dir_does_not_wedge_discovery(
        host_env: Host, aiohttp_client: Any, name: str) -> None:
    host_env.add_runner("good")
    bad = host_env.add_runner("bad")
    (bad / name).unlink(missing_ok=True)
    os.mkfifo(bad / name)
    client = await start(host_env, aiohttp_client)
    found = await runners(client)
    assert "good" in found
    if name == ".fleet-drain":
        assert found["bad"]["draining_since"] == "unknown"


async def test_a_fifo_for_the_deps_file_does_not_wedge_discovery(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    (path / "bin").unlink()  # a fresh install: bin is a directory, its version in the deps file
    (path / "bin").mkdir()
    os.mkfifo(path / "bin" / "Runner.Listener.deps.json")
    client = await start(host_env, aiohttp_client)
    assert (await runners(client))["r1"]["version"] is None


async def test_huge_runner_files_are_not_read_whole(
        host_env: Host, aiohttp_client: Any) -> None:
    """Sparse files, so nothing is written to the disk. A 5 GB marker ended discovery with a
    MemoryError under a 2 GB address-space limit (a Pi's); 64 MiB shows the same here: the
    marker's whole text went into the snapshot, a `.runner` of that size was parsed."""
    marker = host_env.add_runner("r1") / ".fleet-drain"
    marker.touch()
    os.truncate(marker, 64 << 20)
    padded = host_env.add_runner("padded") / ".runner"
    with open(padded, "ab") as handle:
        handle.write(b" " * (2 << 20))  # valid JSON still, but no .runner is that large
    client = await start(host_env, aiohttp_client)
    body = await (await client.get("/api/state")).read()
    assert len(body) < 1 << 20
    found = await runners(client)
    assert set(found) == {"r1"} and found["r1"]["draining_since"] == "unknown"


@pytest.mark.parametrize("name", [".fleet-drain", ".service"])
async def test_invalid_utf8_in_a_runner_file_does_not_stop_the_daemon(
        host_env: Host, aiohttp_client: Any, name: str) -> None:
    host_env.add_runner("good")
    bad = host_env.add_runner("bad")
    (bad / name).write_bytes(b"\xff\xfe\xc3(2026-01-01\x80")
    client = await start(host_env, aiohttp_client)
    assert set(await runners(client)) == {"good", "bad"}


@pytest.mark.parametrize("content", [
    "[" * 100_000 + "]" * 100_000,
    '{"agentName": ' + "[" * 100_000,
    "null", "[]", '"r1"', "\ufeff\ufeff{}", '{"agentName": "bad\\ud800"}',
    '{"agentName": ["bad"], "gitHubUrl": {"x": 1}}',
], ids=["nested-100k", "open-100k", "null", "list", "string", "two-boms", "lone-surrogate",
        "wrong-types"])
async def test_a_runner_file_of_any_shape_is_skipped_not_fatal(
        host_env: Host, aiohttp_client: Any, content: str) -> None:
    host_env.add_runner("good")
    bad = host_env.add_runner("bad")
    (bad / ".runner").write_text(content, encoding="utf-8", errors="surrogatepass")
    client = await start(host_env, aiohttp_client)
    assert set(await runners(client)) == {"good"}


async def test_odd_strings_in_a_runner_file_are_served_as_json(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    data = json.loads((path / ".runner").read_text(encoding="utf-8-sig"))
    data.update({"gitHubUrl": "https://github.com/octo/app\ud800", "labels": ["x\udcff", 3]})
    (path / ".runner").write_text(json.dumps(data), encoding="utf-8")
    client = await start(host_env, aiohttp_client)
    view = (await runners(client))["r1"]
    assert view["url"] == "https://github.com/octo/app\ud800"


async def test_a_fifo_in_the_sibling_does_not_fail_a_duplicate(
        host_env: Host, aiohttp_client: Any) -> None:
    """The copy of a runner's directory met a FIFO a job had left: shutil's copy refused it,
    the action answered 500 and left a half-copied app-2 behind. Such entries are not part
    of an installation and are left out."""
    path = host_env.add_runner("app")
    os.mkfifo(path / "pipe")
    os.mkfifo(path / "bin" / "pipe")
    client = await start(host_env, aiohttp_client)
    await until(lambda: _registration_known(client, "app"))
    resp = await client.post("/api/action",
                             json={"id": "runner.duplicate", "args": {"name": "app"}},
                             headers=auth(cp_of(client)))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["ok"] is True
    copy = host_env.root / "app-2"
    assert (copy / ".runner").is_file() and (copy / "run.sh").is_file()
    assert not os.path.lexists(copy / "pipe") and not os.path.lexists(copy / "bin" / "pipe")


async def _registration_known(client: Any, name: str) -> bool:
    view = (await runners(client)).get(name)
    return bool(view and view["registration"] != "unknown")


# --- _diag, the bundle and command output: what is served is redacted, even when cut ---------

def _cut_inside_a_key(size: int) -> bytes:
    """A log with no line break whose last `size` bytes begin inside `db_password=`: a window
    of that size sees `sword=<secret> ...`, whose key names nothing secret."""
    kept = f"sword={SECRET} and more".encode() + b" filler" * (size // 7)
    kept = kept[:size]
    return b"x " * 5000 + b"db_pas" + kept


async def test_a_log_tail_cut_inside_a_key_does_not_show_its_secret(
        host_env: Host, aiohttp_client: Any) -> None:
    from fleet_min.controlplane.runners.diag import TAIL_BYTES
    path = host_env.add_runner("r1")
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_1.log").write_bytes(_cut_inside_a_key(TAIL_BYTES))
    client = await start(host_env, aiohttp_client)
    detail = await (await client.get("/api/runner?name=r1")).text()
    bundle = await (await client.get("/api/runner/bundle?name=r1",
                                     headers=auth(cp_of(client)))).text()
    # Booleans, not `in` asserts: pytest's diff of 64 KiB of text takes longer than the test.
    assert (SECRET in detail, SECRET in bundle) == (False, False)


async def test_terminal_escapes_in_a_runner_log_are_shown_as_escapes(
        host_env: Host, aiohttp_client: Any) -> None:
    """A runner's log quotes job and step names from workflow files, which a pull request's
    author writes: cursor moves, an erase-line, a hyperlink or a direction override in one
    would redraw the tail where a person reads it (`cat` of the bundle, a terminal). Each is
    served as its escape, in the detail and the bundle."""
    path = host_env.add_runner("r1")
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_1.log").write_text(
        "[2026-11-27 10:00:00Z INFO Worker] step 'build'\n"
        "[2026-11-27 10:00:01Z ERR  Worker] job failed\x1b[2K\x1b[1A all good "
        "\x1b]8;;https://evil.example/\x07link\x1b]8;;\x07 \u202edesrever\n")
    client = await start(host_env, aiohttp_client)
    detail = await (await client.get("/api/runner?name=r1")).json()
    bundle = await (await client.get("/api/runner/bundle?name=r1",
                                     headers=auth(cp_of(client)))).text()
    logs = detail["diag"]
    shown = "".join(logs["tail"]) + logs["last_error"] + bundle
    assert not any(char in shown for char in "\x1b\x07\u202e"), shown
    assert "\\x1b[2K" in bundle and "\\u202edesrever" in bundle
    assert logs["last_error"].endswith("\\u202edesrever"), logs["last_error"]


async def test_command_output_cut_inside_a_key_does_not_show_its_secret(
        host_env: Host, tmp_path: Path, aiohttp_client: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet_min.controlplane.runners.commands import MAX_OUTPUT
    printed = tmp_path / "printed"
    printed.write_bytes(_cut_inside_a_key(MAX_OUTPUT))
    script = tmp_path / "health"
    script.write_text(f"#!/bin/sh\ncat '{printed}'\n")
    script.chmod(0o755)
    host_env.env["FLEET_HEALTH_SCRIPT"] = str(script)
    monkeypatch.setenv("FLEET_HEALTH_SCRIPT", str(script))
    client = await start(host_env, aiohttp_client)
    resp = await client.post("/api/action", json={"id": "health.check", "args": {}},
                             headers=auth(cp_of(client)))
    assert resp.status == 200
    leaked = SECRET in await resp.text()
    assert not leaked


# A command that prints without end: 256 MiB in lines of 1 KiB, run from a process of its own
# so that its peak memory is this alone.
_FLOOD = """
import asyncio, sys
from fleet_min.controlplane.runners import commands
printer = ("import sys\\nline = b'y' * 1023 + b'\\\\n'\\n"
           "for n in range(262144): sys.stdout.buffer.write(line)\\nprint('last line')")
result = asyncio.run(commands.run([sys.executable, "-c", printer], timeout_s=60,
                                  parse_only=sys.argv[1] == "parsed"))
# VmHWM, not ru_maxrss: that one counts the parent's memory at the fork before exec.
with open("/proc/self/status") as status:
    peak_mib = next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) // 1024
print(result.code, len(result.output), result.output.endswith("y\\nlast line\\n"), peak_mib)
"""


@pytest.mark.parametrize("kind", ["shown", "parsed"])
def test_a_command_that_prints_without_end_costs_only_what_is_kept(kind: str) -> None:
    """commands.run keeps the end of what a command prints as it arrives: the process's peak
    memory grows by a few times what is kept (64 KiB shown, 16 MiB parsed), never by the
    256 MiB printed (it held it all and cut it afterwards: a peak of 537 MiB)."""
    import subprocess
    import sys

    from fleet_min.controlplane.runners.commands import MAX_OUTPUT, MAX_PARSED
    done = subprocess.run([sys.executable, "-c", _FLOOD, kind], capture_output=True, text=True,
                          timeout=60, check=True)
    code, length, whole_end, peak_mib = done.stdout.split()
    kept = MAX_OUTPUT if kind == "shown" else MAX_PARSED
    assert (code, whole_end) == ("0", "True")
    assert kept - 1024 <= int(length) <= kept  # whole lines only: the cut one is dropped
    assert int(peak_mib) < 64 + 3 * kept // 2**20, done.stdout


async def test_a_bundle_names_a_file_whose_name_is_not_utf8(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    with open(os.fsencode(path) + b"/odd-\xff-name", "wb") as handle:
        handle.write(b"x")
    client = await start(host_env, aiohttp_client)
    resp = await client.get("/api/runner/bundle?name=r1", headers=auth(cp_of(client)))
    assert resp.status == 200
    assert "odd-" in await resp.text()
    assert (await client.get("/api/runner?name=r1")).status == 200


async def test_file_names_a_job_leaves_cannot_redraw_forge_or_blank_the_bundle(
        host_env: Host, aiohttp_client: Any) -> None:
    """A job runs as the runner's user and names the files it leaves in the runner's
    directory. The bundle listed the names raw: an ESC/BEL name cleared the terminal of
    whoever `cat`s the bundle and set its title, a name with line breaks forged a second
    state section, and a name that is a private key's header had the key-block rule redact
    everything after it (the log tail and the events vanished). A key block cut off in one
    included file blanked the files after it in the same way. Names and file lines are now
    shown as escapes, and each section, file and name is redacted on its own."""
    path = host_env.add_runner("r1")
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_1.log").write_text(
        "[2026-11-28 05:00:00Z INFO Worker] TRACE-THE-JOB-WOULD-HIDE\n")
    _empty_files(path, ["\x1b]0;owned\x07\x1b[2J\x1b[31mESCAPE",
                        "x\n===== state =====\nname: forged", "-----BEGIN PRIVATE KEY-----"])
    (path / ".env").write_text("A=1\nB=\x1b[2Jcleared\x07\n-----BEGIN PRIVATE KEY-----\n"
                               "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n")
    (path / "run.sh").write_text("#!/bin/sh\necho RUN-SH-KEPT\n")
    client = await start(host_env, aiohttp_client)
    resp = await client.get("/api/runner/bundle?name=r1", headers=auth(cp_of(client)))
    assert resp.status == 200
    bundle = await resp.text()
    lines = bundle.splitlines()
    assert not any(char in bundle for char in "\x1b\x07"), repr(bundle)
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mESCAPE (not on the allow-list)" in lines
    assert "B=\\x1b[2Jcleared\\x07" in lines and "A=1" in lines
    # One state section: the forged one is one line of the excluded section.
    assert lines.count("===== state =====") == 1
    assert "x\\x0a===== state =====\\x0aname: forged (not on the allow-list)" in lines
    # The key-named file and the cut key block hide nothing after them.
    assert "<redacted> (not on the allow-list)" in lines
    assert "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" not in bundle
    assert "echo RUN-SH-KEPT" in lines
    for title in ("files", "excluded", "_diag summary", "_diag tail", "recent events",
                  "recent jobs"):
        assert lines.count(f"===== {title} =====") == 1, title
    assert "[2026-11-28 05:00:00Z INFO Worker] TRACE-THE-JOB-WOULD-HIDE" in lines


LOG_SECRET = "Zq7c41d09e5b"  # a value found by its key's name only
# Forms the redactor once missed, as a runner's log holds them (test_redact.py has them all).
MISSED_LOG_LINES = [
    r'payload {\"password\":\"<S>\"}',
    "\x1b[33mDB_PASSWORD\x1b[0m=<S>",
    "GITHUB_TOKEN\t<S>",
    'DEPLOY_SECRET="<S>',
    "redirect=https%3A%2F%2Fx%2Fcb%3Faccess_token%3D<S>",
    '{"pass":"<S>"}',
]


async def test_secrets_in_forms_once_missed_stay_out_of_the_daemons_answers(
        host: Host, http: aiohttp.ClientSession) -> None:
    """Each of these came back whole from the unauthenticated GET /api/runner (the log's
    tail) and seven times from the bundle. Through a real daemon, each is now `<redacted>`,
    and the coloured key is still shown as escapes around it."""
    path = host.add_runner("r1")
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_20261128-050000-utc.log").write_text("".join(
        f"[2026-11-28 05:00:00Z INFO Worker] {line.replace('<S>', LOG_SECRET)}\n"
        for line in MISSED_LOG_LINES))
    (path / ".env").write_text(r'CONFIG_JSON={\"password\":\"<S>\"}'.replace("<S>", LOG_SECRET)
                               + f"\nGITHUB_TOKEN\t{LOG_SECRET}\n")
    daemon = Daemon(host)
    try:
        async def detail() -> dict[str, Any] | None:
            async with http.get(f"{daemon.url}/api/runner?name=r1") as resp:
                return dict(await resp.json()) if resp.status == 200 else None
        shown = await until(detail, timeout=10)
        tail = shown["diag"]["tail"]
        assert len(tail) == len(MISSED_LOG_LINES) and all("<redacted>" in line for line in tail)
        assert LOG_SECRET not in json.dumps(shown)
        assert "[2026-11-28 05:00:00Z INFO Worker] \\x1b[33mDB_PASSWORD\\x1b[0m=<redacted>" \
            in tail
        async with http.get(f"{daemon.url}/api/runner/bundle?name=r1",
                            headers=daemon.headers()) as resp:
            assert resp.status == 200
            bundle = await resp.text()
        assert (LOG_SECRET in bundle, bundle.count("<redacted>") >= 8) == (False, True)
    finally:
        daemon.stop()


# --- what held: kept so it stays so ------------------------------------------------------------

async def test_a_secret_in_a_file_name_is_redacted_in_the_bundle(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    token = "ghp_" + "a1B2c3D4e5" * 4
    (path / token).write_text("x")
    (path / f"password={SECRET}").write_text("x")
    (path / ".env").write_text(f"A=1\nDEPLOY_TOKEN={SECRET}\nURL=https://u:{SECRET}@h.example/\n")
    client = await start(host_env, aiohttp_client)
    text = await (await client.get("/api/runner/bundle?name=r1",
                                   headers=auth(cp_of(client)))).text()
    assert token not in text and SECRET not in text and "A=1" in text


async def test_links_and_fifos_in_diag_are_not_read(
        host_env: Host, aiohttp_client: Any) -> None:
    path = host_env.add_runner("r1")
    (path / ".credentials").write_text(CREDENTIAL)
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_1.log").symlink_to(path / ".credentials")
    (path / "_diag" / "Runner_2.log").symlink_to("/etc/passwd")
    (path / "_diag" / "Runner_3.log").symlink_to(path / "_diag")  # a loop
    os.mkfifo(path / "_diag" / "Runner_4.log")
    (path / "_diag" / "Worker_1.log").write_bytes(b"ok \xff\xfe line\n")
    client = await start(host_env, aiohttp_client)
    detail = await (await client.get("/api/runner?name=r1")).json()
    assert detail["diag"]["files"] == 1 and detail["diag"]["latest"]["name"] == "Worker_1.log"
    bundle = await (await client.get("/api/runner/bundle?name=r1",
                                     headers=auth(cp_of(client)))).text()
    assert CREDENTIAL not in bundle and "root:x:0:0" not in bundle


def _empty_files(folder: Path, names: list[str]) -> None:
    for name in names:
        os.close(os.open(folder / name, os.O_CREAT | os.O_WRONLY, 0o600))


async def test_a_diag_of_many_files_costs_a_bounded_walk(
        host_env: Host, aiohttp_client: Any) -> None:
    """A job can fill its runner's `_diag` with empty `*.log` files, and the runner's detail is
    served to anyone: 300,000 of them made one request walk, resolve and sort every entry
    (40 s, 340 MB). At most SCAN_LIMIT entries are examined, what is kept does not grow with
    the directory, and the answer and the bundle say that more entries were left unexamined."""
    path = host_env.add_runner("r1")
    (path / "_diag").mkdir()
    count = 30_000  # three times diag.SCAN_LIMIT
    _empty_files(path / "_diag", [f"Worker_{n:06d}.log" for n in range(count)])
    tracemalloc.start()
    try:
        summary = diag.summary_and_tail(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Every entry kept (a path and its stat for each, then a sorted copy) came to ~1 kB an
    # entry, 30 MB here; a bounded walk keeps a few candidates, tens of kB.
    assert peak < 2 * 1024 * 1024, peak
    assert (summary["entries_examined"], summary["more_entries"], summary["files"]) == (
        diag.SCAN_LIMIT, True, diag.SCAN_LIMIT)
    assert summary["latest"]["name"].startswith("Worker_")
    client = await start(host_env, aiohttp_client)
    detail = (await (await client.get("/api/runner?name=r1")).json())["diag"]
    assert (detail["entries_examined"], detail["more_entries"]) == (diag.SCAN_LIMIT, True)
    bundle = await (await client.get("/api/runner/bundle?name=r1",
                                     headers=auth(cp_of(client)))).text()
    assert f"entries examined: {diag.SCAN_LIMIT}\nmore entries: yes" in bundle


async def test_a_bundle_lists_a_bounded_number_of_a_runner_directorys_entries(
        host_env: Host, aiohttp_client: Any) -> None:
    """A job can fill its runner's directory too: the bundle sorted and listed every entry off
    the allow-list. It lists the first EXCLUDED_LISTED by name, counts the rest among the
    SCAN_LIMIT entries it looks at, and says when there were more."""
    path = host_env.add_runner("r1")
    _empty_files(path, [f"junk-{n:06d}" for n in range(3 * diag.SCAN_LIMIT)])
    client = await start(host_env, aiohttp_client)
    resp = await client.get("/api/runner/bundle?name=r1", headers=auth(cp_of(client)))
    assert resp.status == 200
    text = await resp.text()
    listed = [line for line in text.splitlines()
              if line.endswith(("(not on the allow-list)", "(credentials, never read)"))]
    assert len(listed) == bundle.EXCLUDED_LISTED and listed == sorted(listed)
    assert "more entries, not listed)" in text
    assert f"(the directory holds more than {diag.SCAN_LIMIT} entries" in text
    assert len(text) < 64 * 1024, len(text)


async def test_the_newest_runner_log_is_read_among_many(
        host_env: Host, aiohttp_client: Any) -> None:
    """Only the newest few logs are kept while `_diag` is walked: the newest Runner_ log is
    still the one read, ahead of a newer Worker_ log, and a newer link or FIFO named as a
    Runner_ log is passed over; the counts cover every log."""
    path = host_env.add_runner("r1")
    folder = path / "_diag"
    folder.mkdir()
    (path / ".credentials").write_text(CREDENTIAL)
    old = [f"Runner_{n:05d}.log" for n in range(2000)] + [f"Worker_{n:05d}.log"
                                                           for n in range(2000)]
    _empty_files(folder, old)
    for name in old:
        os.utime(folder / name, (1_000_000, 1_000_000))
    (folder / "Runner_newest.log").write_text("[2026-11-27 10:00:00Z ERR  Runner] newest\n")
    os.utime(folder / "Runner_newest.log", (2_000_000, 2_000_000))
    (folder / "Worker_newer.log").write_text("worker\n")
    os.utime(folder / "Worker_newer.log", (3_000_000, 3_000_000))
    (folder / "Runner_zlink.log").symlink_to(path / ".credentials")
    os.mkfifo(folder / "Runner_zfifo.log")
    client = await start(host_env, aiohttp_client)
    detail = (await (await client.get("/api/runner?name=r1")).json())["diag"]
    assert detail["latest"]["name"] == "Runner_newest.log"
    assert detail["last_error"].endswith("newest") and CREDENTIAL not in str(detail)
    assert (detail["files"], detail["total_bytes"]) == (
        len(old) + 2, (folder / "Runner_newest.log").stat().st_size + len("worker\n"))
    assert (detail["entries_examined"], detail["more_entries"]) == (len(old) + 4, False)


async def test_a_runner_dir_linked_out_of_the_root_is_not_discovered(
        host_env: Host, tmp_path: Path, aiohttp_client: Any) -> None:
    host_env.add_runner("r1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "loop").symlink_to(elsewhere)
    (host_env.root / "linked").symlink_to(elsewhere)
    (host_env.root / "self").symlink_to(host_env.root)
    client = await start(host_env, aiohttp_client)
    assert set(await runners(client)) == {"r1"}


@pytest.mark.parametrize("name", ["..%2f..%2fetc", "..%2F", "%2e%2e", "r1%0a", "r1%00",
                                  "-r1", "--help", "r1;id", "r1%20", "r1/..", "$(id)"])
async def test_a_runner_name_is_checked_before_any_path_is_built(
        host_env: Host, aiohttp_client: Any, name: str) -> None:
    host_env.add_runner("r1")
    client = await start(host_env, aiohttp_client)
    assert (await client.get(f"/api/runner?name={name}")).status == 400
    cp = cp_of(client)
    assert (await client.get(f"/api/runner/bundle?name={name}", headers=auth(cp))).status == 400
    resp = await client.post("/api/action", headers=auth(cp),
                             json={"id": "runner.drain", "args": {"name": name}})
    assert resp.status == 400


def test_a_process_with_odd_arguments_is_read_from_proc(tmp_path: Path) -> None:
    """/proc/<pid>/cmdline is bytes: invalid UTF-8 is replaced, a long one read whole, and a
    process that has exited is simply not there."""
    import subprocess
    import sys

    from fleet_min.controlplane.runners.procs import process_table
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("no /proc here")
    odd = os.fsencode(tmp_path) + b"/r\xff\xfe/bin/Runner.Worker"
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; print('up', flush=True); sys.stdin.read()", odd,
                              "x" * 100_000], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # Popen returns when exec closes the error pipe, a moment before the kernel records
        # where the new argv lies: until then /proc/<pid>/cmdline reads empty. A line from the
        # child itself says the exec is complete.
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        mine = [p for p in process_table() if p.pid == child.pid]
        assert len(mine) == 1 and mine[0].argv[4] == "x" * 100_000
        assert mine[0].argv[3].endswith("/r\ufffd\ufffd/bin/Runner.Worker")
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    assert not [p for p in process_table() if p.pid == child.pid]


def test_a_log_gone_or_swapped_after_its_check_reads_as_nothing(tmp_path: Path) -> None:
    """Between listing _diag and reading the newest log, the runner may rotate it away or a job
    may swap in a FIFO or a link: the read neither raises, waits nor follows."""
    fifo, link, target = tmp_path / "Runner_1.log", tmp_path / "Runner_2.log", tmp_path / "t"
    os.mkfifo(fifo)
    target.write_text("db_password=" + SECRET + "\n")
    link.symlink_to(target)
    assert diag.read_tail(fifo) == ""
    assert diag.read_tail(link) == ""
    assert diag.read_tail(tmp_path / "Runner_gone.log") == ""
    assert diag.read_tail(target) == "db_password=" + SECRET + "\n"


async def test_every_runner_of_a_large_host_has_its_service_state(host_env: Host,
                                                                  aiohttp_client: Any) -> None:
    """One `systemctl show` answers for every unit at once, about 130 bytes a unit: its output
    is parsed, never shown, and is not cut to the 64 KiB that shown output keeps (at 700
    runners the first units' states were lost, and those runners read as without a service)."""
    count = 700
    for n in range(count):
        host_env.add_runner(f"r{n:04d}", registered=False)
    client = await start(host_env, aiohttp_client)
    views = await runners(client)
    assert len(views) == count
    unloaded = sorted(name for name, view in views.items() if not view["service"]["loaded"])
    assert unloaded == []
