"""Running host commands: always an argv list, always a timeout, output capped and redacted.

Each command gets its own session so a timeout kills the whole process group (config.sh starts
children), and stdin is closed so nothing can wait for a password prompt. Output is redacted
unless the caller only parses it (`parse_only`: the supervisor's state queries, whose output is
never shown, logged or stored; redacting 200 units' `systemctl show` cost ~10 ms a rebuild).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shlex
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet_min.controlplane.runners.redact import redact

MAX_OUTPUT = 64 * 1024  # of output shown to a person, stored or logged: its end
# Of output that is only parsed: `systemctl show` answers for every unit at once, about 130
# bytes a unit, so 64 KiB would lose the first units of a host with 500 runners. This only
# bounds memory.
MAX_PARSED = 16 * 1024 * 1024
_READ_BYTES = 64 * 1024
_WITHHELD = frozenset({"GH_TOKEN", "GITHUB_TOKEN"})


@dataclass
class CommandResult:
    argv: list[str]
    code: int | None  # None: it could not start or was killed at the timeout
    output: str
    duration_ms: int
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def command(self) -> str:
        return redact(shlex.join(self.argv))


async def run(argv: Sequence[str], *, timeout_s: float, cwd: Path | None = None,
              env: Mapping[str, str] | None = None, parse_only: bool = False) -> CommandResult:
    """Run argv; secrets for the child go in `env` (merged over ours), never in argv.

    parse_only: the output is returned as the command printed it (not redacted). Only for
    output that is parsed into fixed fields and never shown to a person, logged or stored."""
    started = time.monotonic()
    argv = [str(a) for a in argv]
    # Our own GitHub token is not the child's business (config.sh gets its one-time token in
    # `env`; the health script gets none).
    child_env = {k: v for k, v in os.environ.items() if k not in _WITHHELD}
    child_env.update(env or {})
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=child_env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
    except OSError as exc:
        return CommandResult(argv, None, f"could not start {argv[0]}: {exc.strerror}",
                             _ms(started))
    try:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that arrives
        # as the command exits (see loops.py), and the daemon's shutdown would then hang.
        async with asyncio.timeout(timeout_s):
            assert proc.stdout is not None
            out = await _tail(proc.stdout, MAX_PARSED if parse_only else MAX_OUTPUT)
            await proc.wait()
    except TimeoutError:
        _kill_group(proc.pid)
        await _reap(proc, 5)
        return CommandResult(argv, None, f"{argv[0]} did not finish within {timeout_s:g} s "
                             "and was stopped", _ms(started), timed_out=True)
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        # Reap it before going on: an unreaped child outlives the loop and warns at exit.
        await _reap(proc, 2)
        raise
    text = out.decode("utf-8", "replace")
    return CommandResult(argv, proc.returncode, text if parse_only else redact(text),
                         _ms(started))


async def _tail(stream: asyncio.StreamReader, limit: int) -> bytes:
    """The whole lines among the last `limit` bytes a command prints before it closes its
    output. Read as it arrives, keeping only the chunks that reach into those last bytes, so a
    command that prints gigabytes costs a few times the limit of memory, never what it printed.

    A line cut by the limit is dropped whole: its start (a key, a token's prefix) is gone, so
    the redactor could not tell its secret (as in diag.read_tail)."""
    chunks: collections.deque[bytes] = collections.deque()
    held = 0
    while chunk := await stream.read(_READ_BYTES):
        chunks.append(chunk)
        held += len(chunk)
        while held - len(chunks[0]) >= limit:  # the oldest chunk is wholly before the end kept
            held -= len(chunks.popleft())
    if held > limit:
        # What is kept starts inside the first chunk: from the first line that begins there.
        first = chunks[0][held - limit:]
        while b"\n" not in first and len(chunks) > 1:
            chunks.popleft()
            first = chunks[0]
        chunks[0] = first.partition(b"\n")[2]
    return b"".join(chunks)


async def _reap(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await proc.wait()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
