"""Whose files the daemon runs. A script in a runner's directory (config.sh, svc.sh) runs with
the rights of whoever runs it, and whoever can change the script, or rename anything in a
directory above it, chooses what runs. A runner's directory is written by its jobs (arbitrary
code of a repository's workflows, running as the runner's account), so the daemon runs such a
script only when no account but the one it runs as, or root, could have changed it: as the
daemon's own account when that owns the runner (the documented setup, where a job has the
daemon's rights already and gains nothing), never as root on behalf of another account
(`sudo -n svc.sh`, or a daemon running as root over a runner another account owns).

The rule is sshd's for authorized_keys: the file and every directory above it owned by that
account or by root, none writable by its group or by anyone, except a sticky directory (/tmp),
where no one may rename what another owns.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from fleet_min.errors import Conflict


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def writers_problem(script: Path, runs_as: int) -> str | None:
    """Why running `script` as `runs_as` would let another account choose what runs; None
    when only that account or root could have changed the script or a directory above it.

    Both the path as named and the path its links lead to are checked. A link itself is not:
    no one changes a link, only replaces it, which takes the directory it is in (checked)."""
    try:
        resolved = script.resolve(strict=True)
        for part in dict.fromkeys((script, *script.parents, resolved, *resolved.parents)):
            info = os.lstat(part)
            if stat.S_ISLNK(info.st_mode):
                continue
            if info.st_uid not in (0, runs_as):
                return f"{part} belongs to {_owner(info.st_uid)}"
            sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
                return f"{part} can be written by its group or by anyone"
    except OSError as exc:
        return f"{script} cannot be checked ({exc.strerror or exc})"
    return None


def check_runnable(script: Path, runs_as: int, what: str | None = None) -> None:
    """Refuse (409) to run `script` (`what`, its name by default) as `runs_as` when another
    account could have chosen what it runs."""
    problem = writers_problem(script, runs_as)
    if problem is None:
        return
    who = "root" if runs_as == 0 else _owner(runs_as)
    raise Conflict(f"the control plane will not run {what or script.name} as {who}: "
                   f"{problem}, so a job of the runner could have changed what it runs; run "
                   f"it yourself in {script.parent} as the account that owns it, or run the "
                   "control plane as that account")
