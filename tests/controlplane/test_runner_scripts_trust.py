"""What the daemon runs and copies of a runner's directory, which the runner's jobs write. It
runs config.sh and svc.sh only where no other account could have chosen what they run (a script
another account can change runs that account's code with the daemon's rights: root, for svc.sh
under sudo), and a duplicate copies the installation, not what a job left beside it. Real
control plane over HTTP; config.sh, systemctl and sudo are fakes on PATH."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Any

import pytest

from fleet_min.controlplane.runners.trust import writers_problem
from tests.support.controlplane import Host, auth, cp_of, until
from tests.support.cp_fakes import pid_alive

NOBODY = 65534  # an account that is neither root nor the one the tests run as


async def act(client: Any, action: str, **args: Any) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/api/action", json={"id": action, "args": args},
                             headers=auth(cp_of(client)))
    return resp.status, await resp.json()


async def registered(client: Any, name: str) -> bool:
    runners = (await (await client.get("/api/state")).json())["runners"]
    return any(r["name"] == name and r["registration"] == "registered" for r in runners)


def loosen(path: Path) -> None:
    path.chmod(path.stat().st_mode | stat.S_IWGRP | stat.S_IWOTH)


async def test_a_runner_directory_others_may_write_is_not_run_from(host: Host,
                                                                   client: Any) -> None:
    """Deregister and duplicate refuse, with a sentence, before any script of it runs."""
    path = host.add_runner("r1")
    await until(lambda: registered(client, "r1"))
    loosen(path)
    before = len(host.calls("config.sh"))
    status, body = await act(client, "runner.deregister", name="r1")
    assert status == 409, body
    who = pwd.getpwuid(os.geteuid()).pw_name
    assert body["error"] == (
        f"the control plane will not run config.sh as {who}: {path} can be written by its "
        "group or by anyone, so a job of the runner could have changed what it runs; run it "
        f"yourself in {path} as the account that owns it, or run the control plane as that "
        "account")
    status, body = await act(client, "runner.duplicate", name="r1")
    assert status == 409 and "can be written by its group or by anyone" in body["error"], body
    assert len(host.calls("config.sh")) == before  # nothing of it ran
    assert (path / ".runner").exists() and not (host.root / "r2").exists()


async def test_a_refused_deregister_leaves_the_service_as_it_was(host: Host,
                                                                  client: Any) -> None:
    """The refusal comes before the first step: deregister stopped the runner's service,
    disabled it and deleted its unit, then refused to run config.sh, and the audit log said
    the action was refused."""
    path = host.add_runner("r1")
    listener = host.start_unit("r1")
    await until(lambda: registered(client, "r1"))
    loosen(path / "config.sh")
    before = len(host.calls("systemctl"))
    status, body = await act(client, "runner.deregister", name="r1")
    assert status == 409 and "will not run config.sh" in body["error"], body
    assert [c["argv"] for c in host.calls("systemctl")[before:]
            if "show" not in c["argv"]] == []
    assert pid_alive(listener)
    assert (host.xdg / "systemd" / "user" / host.unit("r1")).exists()


async def test_a_loose_bin_stops_a_duplicate(host: Host, client: Any) -> None:
    """A duplicate's binaries are the sibling's (hard links), and its config.sh runs them."""
    path = host.add_runner("build-1")
    await until(lambda: registered(client, "build-1"))
    loosen(path / "bin")
    status, body = await act(client, "runner.duplicate", name="build-1")
    assert status == 409, body
    assert body["error"].startswith("the control plane will not run the runner's binaries "
                                    "(bin) as")
    assert f"{(path / 'bin').resolve()} can be written" in body["error"]
    assert not (host.root / "build-2").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another account needs root")
async def test_a_script_another_account_owns_is_not_run_as_root(host: Host, client: Any
                                                                 ) -> None:
    """A daemon running as root over a runner another account installed: the job runs as that
    account and writes config.sh; the daemon would run it as root."""
    path = host.add_runner("r1")
    await until(lambda: registered(client, "r1"))
    os.chown(path / "config.sh", NOBODY, -1)
    status, body = await act(client, "runner.deregister", name="r1")
    assert status == 409, body
    assert f"{path / 'config.sh'} belongs to nobody" in body["error"]
    assert body["error"].startswith("the control plane will not run config.sh as root")
    assert (path / ".runner").exists()


def test_the_rule_follows_links_and_trusts_sticky_directories(tmp_path: Path) -> None:
    """tmp_path is under /tmp (sticky, writable by anyone): no one may rename what another owns
    there. A link is judged by where it leads and by the directory that holds it."""
    me = os.geteuid()
    script = tmp_path / "runner" / "config.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    assert writers_problem(script, me) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "Runner.Listener").write_text("")
    (script.parent / "bin").symlink_to(elsewhere)
    assert writers_problem(script.parent / "bin", me) is None
    loosen(elsewhere)
    assert writers_problem(script.parent / "bin", me) == (
        f"{elsewhere} can be written by its group or by anyone")
    assert writers_problem(script.parent / "gone.sh", me).startswith(
        f"{script.parent / 'gone.sh'} cannot be checked")


async def test_a_duplicate_copies_the_installation_and_not_what_a_job_left(host: Host,
                                                                           client: Any) -> None:
    """A job writes its runner's directory: a 2 MB file or a directory of its own there was
    copied into every duplicate (a 10 GB one filled the disk). Only the installation goes."""
    path = host.add_runner("build-1")
    await until(lambda: registered(client, "build-1"))
    (path / ".env").write_text("LANG=C.UTF-8\n")
    (path / "left-by-a-job.bin").write_bytes(b"\0" * (2 << 20))
    (path / "cache").mkdir()
    (path / "cache" / "blob").write_bytes(b"\0" * 1000)
    (path / "externals.2.311.0").mkdir()
    (path / "externals.2.311.0" / "node").write_bytes(b"\0" * (2 << 20))
    status, body = await act(client, "runner.duplicate", name="build-1")
    assert status == 200 and body["ok"], body
    copy = host.root / "build-2"
    kept = sorted(entry.name for entry in copy.iterdir())
    assert "left-by-a-job.bin" not in kept and "cache" not in kept, kept
    assert {"bin", "bin.2.311.0", "config.sh", "run.sh", "svc.sh", ".env",
            "externals.2.311.0", ".runner"} <= set(kept), kept
    assert (copy / ".env").read_text() == "LANG=C.UTF-8\n"
    # The binaries are the sibling's, linked: a large one is not left out.
    assert os.stat(copy / "externals.2.311.0" / "node").st_ino == \
        os.stat(path / "externals.2.311.0" / "node").st_ino


@pytest.mark.parametrize("label", ["--ephemeral", "-x", "gpu,arm64"])
async def test_a_label_config_sh_would_misread_stops_a_duplicate(host: Host, client: Any,
                                                                 label: str) -> None:
    """A duplicate passes the sibling's custom labels, from GitHub, to config.sh as one
    comma-separated argument: `--labels --ephemeral,gpu` registered a copy of another kind."""
    host.add_runner("build-1", labels=["gpu", label])
    await until(lambda: registered(client, "build-1"))
    status, body = await act(client, "runner.duplicate", name="build-1")
    assert status == 409, body
    assert body["error"] == (f"build-1's label {label!r} cannot be passed to config.sh (a comma "
                             "splits it, a leading '-' reads as an option); rename it at GitHub "
                             "or register the copy by hand")
    assert not host.calls("config.sh") and not (host.root / "build-2").exists()
