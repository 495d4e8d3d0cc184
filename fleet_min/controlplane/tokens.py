"""The control and agent tokens: 32 random bytes, hex, in owner-only files under the state dir.

Rotation is "delete the file and restart", so a file that is shorter than a token, not hex, or
unreadable is replaced rather than trusted. A token file is never read through a symbolic link:
one planted while the state directory was loose could hand the daemon a token its planter knows
(the control token is refused with a sentence; an agent-token link is not read). For the same
reason a token file is trusted only when it is a regular file this user owns, with one name:
another user's file, or a hard link, is replaced (the agent token's is not read).

A host token (`token --agent-host NAME`) is the agent token narrowed to one agent host:
`NAME~` and an HMAC of the name under the agent token. The coordinator checks it with the agent
token it already holds (nothing more is stored), and a heartbeat or result post it carries may
speak for NAME only. Rotating the agent token rotates every host token with it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from fleet_min import filemodes

CONTROL_FILE = "control-token"
AGENT_FILE = "agent-token"
_TOKEN = re.compile(r"[0-9a-f]{64}")


def _read_valid(path: Path) -> str | None:
    try:
        # A FIFO, a link or a device in its place is not read (and is replaced), never waited on.
        fd, st = filemodes.open_regular(path)
    except (OSError, ValueError):
        return None
    try:
        if not _ours(st):
            return None
        text = os.read(fd, 200).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    return text if _TOKEN.fullmatch(text) else None


def _ours(st: os.stat_result) -> bool:
    """A token file this user (or root, who could read it anyway) made: a regular file with
    one name. One another user wrote (while the state directory was loose) is a token they
    know, and a second name (a hard link) may be one they can still read."""
    euid = filemodes.effective_uid()
    return st.st_nlink == 1 and (euid is None or st.st_uid in (euid, 0))


def _write_new(path: Path) -> str:
    token = secrets.token_bytes(32).hex()
    filemodes.private_dir(path.parent, filemodes.CONTROLPLANE_DIR)
    tmp = path.with_name(path.name + ".new")
    # A fresh name made with mode 0600: the token is never readable by others, not even for the
    # moment between create and chmod, and a link at the name is never written through.
    filemodes.write_new(tmp, f"{token}\n".encode("ascii"), filemodes.CONTROLPLANE_FILE)
    os.replace(tmp, path)
    return token


def ensure_token(state_dir: Path, name: str = CONTROL_FILE) -> str:
    """The token stored in `state_dir/name`, created (or replaced when invalid) as needed;
    filemodes.NotPrivate when that name is a symbolic link."""
    path = state_dir / name
    filemodes.refuse_link(path)
    token = _read_valid(path)
    if token is not None:
        # Someone loosened it: a token readable by others is not a secret.
        filemodes.tighten(path, filemodes.CONTROLPLANE_FILE)
        return token
    return _write_new(path)


def agent_token(state_dir: Path, control: str) -> str:
    """The agent token: its own file when present and valid, else the control token."""
    return _read_valid(state_dir / AGENT_FILE) or control


class AgentToken:
    """The agent token as a running daemon holds it (see agent_token), read again whenever its
    file changes: a token made with `token --agent` while the daemon runs, and every host token
    made from it, is good at once instead of after a restart, and removing the file falls back
    to the control token the same way."""

    def __init__(self, state_dir: Path, control: str) -> None:
        self.path = state_dir / AGENT_FILE
        self.control = control
        self._seen = self._signature()  # before the read: a change in between is read again
        self._value = agent_token(state_dir, control)

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.lstat(self.path)
        except OSError:
            return None
        # A token file another user could read is no secret (tightened as ensure_token does;
        # tighten leaves a link alone, which is never read either).
        filemodes.tighten(self.path, filemodes.CONTROLPLANE_FILE, st.st_mode)
        # A new token is written to a fresh file and renamed over the old: a new inode.
        return st.st_ino, st.st_mtime_ns, st.st_size

    def current(self) -> str:
        seen = self._signature()
        if seen != self._seen:
            self._seen = seen
            self._value = _read_valid(self.path) or self.control
        return self._value


def matches(given: str, expected: str | None) -> bool:
    """Constant-time comparison; nothing matches when no token exists (read-only mode)."""
    if not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("ascii"))


HOST_SEPARATOR = "~"  # not in a host name, and a character bearer tokens may hold (RFC 6750)


def _host_mac(secret: str, host: str) -> str:
    # "replace": a header's bytes that are not UTF-8 reach us as lone surrogates, and such a
    # name is no host's anyway (the coded text only has to be something, not to match).
    return hmac.new(secret.encode("ascii"),
                    f"fleet-min agent host {host}".encode("utf-8", "replace"),
                    hashlib.sha256).hexdigest()


def host_token(secret: str, host: str) -> str:
    """The agent token narrowed to one agent host (see the module's docstring)."""
    return f"{host}{HOST_SEPARATOR}{_host_mac(secret, host)}"


def named_host(given: str) -> str | None:
    """The host a token names when it has the form of a host token, unchecked (an agent reads
    its own token with it); None for any other token."""
    host, separator, _ = given.rpartition(HOST_SEPARATOR)
    return host if separator and host else None


def token_host(given: str, secret: str | None) -> str | None:
    """The host a host token speaks for, when `given` is one made with `secret`; else None.
    The comparison is constant-time, as for the other tokens."""
    host = named_host(given)
    if not secret or host is None:
        return None
    mac = given[len(host) + len(HOST_SEPARATOR):]
    expected = _host_mac(secret, host)
    if not hmac.compare_digest(mac.encode("utf-8", "replace"), expected.encode("ascii")):
        return None
    return host
