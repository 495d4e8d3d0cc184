"""The control and agent tokens: 32 random bytes, hex, in owner-only files under the state dir.

Rotation is "delete the file and restart", so a file that is shorter than a token, not hex, or
unreadable is replaced rather than trusted.
"""

from __future__ import annotations

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
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _TOKEN.fullmatch(text) else None


def _write_new(path: Path) -> str:
    token = secrets.token_bytes(32).hex()
    filemodes.private_dir(path.parent, filemodes.CONTROLPLANE_DIR)
    tmp = path.with_name(path.name + ".new")
    # O_EXCL on a fresh name plus mode 0600 at creation: the token is never readable by others,
    # not even for the moment between create and chmod.
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(token + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return token


def ensure_token(state_dir: Path, name: str = CONTROL_FILE) -> str:
    """The token stored in `state_dir/name`, created (or replaced when invalid) as needed."""
    path = state_dir / name
    token = _read_valid(path)
    if token is not None:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)  # someone loosened it; a token readable by others is not a secret
        return token
    return _write_new(path)


def agent_token(state_dir: Path, control: str) -> str:
    """The agent token: its own file when present and valid, else the control token."""
    return _read_valid(state_dir / AGENT_FILE) or control


def matches(given: str, expected: str | None) -> bool:
    """Constant-time comparison; nothing matches when no token exists (read-only mode)."""
    if not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("ascii"))
