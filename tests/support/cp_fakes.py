"""Fake host tools for the control-plane tests: real executables written into a tmp bin dir.

- `systemctl`: keeps unit state under $FAKE_SYSTEMD_DIR, reads user units from
  $XDG_CONFIG_HOME/systemd/user and system units from $FAKE_SYSTEMD_DIR/system-units, and on
  `start` really runs the unit's ExecStart detached (recording its pid); `stop` really kills it.
- `launchctl`: the same for plists under $HOME/Library/LaunchAgents (list/load/unload).
- a runner installation: `config.sh` (registers/removes through the fake GitHub API with the
  token from ACTIONS_RUNNER_INPUT_TOKEN, writes `.runner` with a BOM), `svc.sh`, `run.sh`, and
  `bin/Runner.Listener`, a small sleeping Python process that starts a `Runner.Worker` child
  while the file `.fake-busy` exists.

Every fake appends its argv to $FAKE_CALLS so tests can see what the daemon ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PY = sys.executable

# Each fake records its call. json is imported only when recording, so a fake that stands for a
# compiled binary (systemctl, started with `python -S`) pays no more than an interpreter start.
_RECORD = r'''
import os, sys

def record(tool):
    path = os.environ.get("FAKE_CALLS")
    if path:
        import json
        with open(path, "a") as handle:
            entry = {"tool": tool, "argv": sys.argv[1:], "cwd": os.getcwd()}
            handle.write(json.dumps(entry) + "\n")
'''

SYSTEMCTL = _RECORD + r'''
record("systemctl")
args = sys.argv[1:]
user = "--user" in args
args = [a for a in args if a not in ("--user", "--no-ask-password", "--")]
base = os.environ["FAKE_SYSTEMD_DIR"]
scope = os.path.join(base, "user" if user else "system")
os.makedirs(scope, exist_ok=True)
xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
units = os.path.join(xdg, "systemd", "user") if user else os.path.join(base, "system-units")

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def pid_of(unit):
    try:
        with open(os.path.join(scope, unit + ".pid")) as handle:
            pid = int(handle.read())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None

def unit_file(unit):
    return os.path.join(units, unit)

def exec_start(unit):
    import shlex
    props = {}
    with open(unit_file(unit)) as handle:
        for line in handle.read().splitlines():
            if "=" in line:
                key, value = line.split("=", 1)
                props[key] = value
    return shlex.split(props["ExecStart"]), props.get("WorkingDirectory")

def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

command, rest = (args[0], args[1:]) if args else ("", [])
if command == "show":
    # One block per unit, blank-line separated, in the order asked (as systemctl show does).
    blocks = []
    for unit in [a for a in rest if not a.startswith("-")]:
        loaded = os.path.exists(unit_file(unit))
        pid = pid_of(unit)
        failed = os.path.exists(os.path.join(scope, unit + ".failed"))
        active = "active" if pid else ("failed" if failed else "inactive")
        sub = "running" if pid else ("failed" if failed else "dead")
        where = (exec_start(unit)[1] or "") if loaded else ""
        blocks.append("\n".join([f"Id={unit}", f"LoadState={'loaded' if loaded else 'not-found'}",
                                 f"ActiveState={active}",
                                 f"SubState={sub}",
                                 f"MainPID={pid or 0}",
                                 f"WorkingDirectory={where}"]))
    print("\n\n".join(blocks))
    sys.exit(0)
if command in ("daemon-reload",):
    sys.exit(0)
unit = rest[0] if rest else ""
if not os.path.exists(unit_file(unit)):
    print(f"Failed to {command} {unit}: Unit {unit} not found.", file=sys.stderr)
    sys.exit(5)
if command == "enable":
    open(os.path.join(scope, unit + ".enabled"), "a").close()
elif command == "disable":
    remove(os.path.join(scope, unit + ".enabled"))
elif command == "start":
    if pid_of(unit) is None:
        import subprocess
        argv, cwd = exec_start(unit)
        log = open(os.path.join(scope, unit + ".log"), "ab")
        proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(scope, unit + ".pid"), "w") as handle:
            handle.write(str(proc.pid))
        remove(os.path.join(scope, unit + ".failed"))
elif command == "stop":
    pid = pid_of(unit)
    if pid:
        import signal, time
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not alive(pid):
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
    remove(os.path.join(scope, unit + ".pid"))
else:
    print(f"fake systemctl: unknown command {command}", file=sys.stderr)
    sys.exit(1)
'''

LAUNCHCTL = _RECORD + r'''
import plistlib, signal, subprocess, time
from pathlib import Path

record("launchctl")
state = Path(os.environ["FAKE_LAUNCHD_DIR"])
state.mkdir(parents=True, exist_ok=True)

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

args = sys.argv[1:]
if args[0] == "list":
    print("PID\tStatus\tLabel")
    for loaded in sorted(state.glob("*.loaded")):
        pid = int(loaded.read_text() or 0)
        print(f"{pid if alive(pid) else '-'}\t{0 if alive(pid) else 1}\t{loaded.stem}")
    sys.exit(0)
plist_path = Path(args[-1])
if args[0] == "load":
    data = plistlib.loads(plist_path.read_bytes())
    label = data["Label"]
    if not (state / (label + ".loaded")).exists():
        log = open(state / (label + ".log"), "ab")
        proc = subprocess.Popen(data["ProgramArguments"], cwd=data.get("WorkingDirectory"),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        (state / (label + ".loaded")).write_text(str(proc.pid))
elif args[0] == "unload":
    label = plistlib.loads(plist_path.read_bytes())["Label"]
    loaded = state / (label + ".loaded")
    if loaded.exists():
        pid = int(loaded.read_text() or 0)
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not alive(pid):
                    break
                time.sleep(0.05)
        loaded.unlink()
'''

CONFIG_SH = _RECORD + r'''
import json, urllib.request, urllib.error
from pathlib import Path

record("config.sh")
here = Path(__file__).resolve().parent
token = os.environ.get("ACTIONS_RUNNER_INPUT_TOKEN")
if not token:
    print("config.sh: no token given", file=sys.stderr)
    sys.exit(1)
api = os.environ["FLEET_GITHUB_API"].rstrip("/")

def call(path, body):
    request = urllib.request.Request(api + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        print(f"config.sh: GitHub refused: {exc.read().decode()}", file=sys.stderr)
        sys.exit(1)

args = sys.argv[1:]
if args and args[0] == "remove":
    data = json.loads((here / ".runner").read_text(encoding="utf-8-sig"))
    repo = "/".join(data["gitHubUrl"].rstrip("/").split("/")[-2:])
    call("/_fake/remove", {"repo": repo, "token": token, "name": data["agentName"]})
    (here / ".runner").unlink()
    print("Runner removed successfully")
    sys.exit(0)
opts = {}
i = 0
while i < len(args):
    if args[i] in ("--unattended", "--replace"):
        i += 1
        continue
    opts[args[i].lstrip("-")] = args[i + 1]
    i += 2
url = opts["url"]
repo = "/".join(url.rstrip("/").split("/")[-2:])
labels = [x for x in opts.get("labels", "").split(",") if x]
reply = call("/_fake/register", {"repo": repo, "token": token, "name": opts["name"],
                                  "labels": labels})
runner = {"agentId": reply["id"], "agentName": opts["name"], "poolId": 1, "poolName": "Default",
          "serverUrl": "https://pipelines.example/abc", "gitHubUrl": url,
          "workFolder": opts.get("work", "_work")}
(here / ".runner").write_text(json.dumps(runner, indent=2), encoding="utf-8-sig")
print(f"Runner successfully added as {opts['name']}")
'''

SVC_SH = _RECORD + r'''
import json
from pathlib import Path

record("svc.sh")
here = Path(__file__).resolve().parent
data = json.loads((here / ".runner").read_text(encoding="utf-8-sig"))
repo = "-".join(data["gitHubUrl"].rstrip("/").split("/")[-2:])
name = f"actions.runner.{repo}.{data['agentName']}"
command = sys.argv[1]
if os.environ.get("FAKE_SVC_MODE") == "launchd":
    import plistlib
    plist = Path(os.environ["HOME"]) / "Library" / "LaunchAgents" / f"{name}.plist"
    if command == "install":
        plist.parent.mkdir(parents=True, exist_ok=True)
        plist.write_bytes(plistlib.dumps({"Label": name, "WorkingDirectory": str(here),
                                          "ProgramArguments": [str(here / "run.sh")]}))
        (here / ".service").write_text(str(plist) + "\n")
    elif command == "uninstall":
        plist.unlink(missing_ok=True)
        (here / ".service").unlink(missing_ok=True)
    sys.exit(0)
units = Path(os.environ["FAKE_SYSTEMD_DIR"]) / "system-units"
if command == "install":
    units.mkdir(parents=True, exist_ok=True)
    (units / f"{name}.service").write_text(
        f"[Service]\nExecStart={here / 'run.sh'}\nWorkingDirectory={here}\n")
    (here / ".service").write_text(f"{name}.service\n")
    print(f"Creating launch runner in /etc/systemd/system/{name}.service")
elif command == "uninstall":
    (units / f"{name}.service").unlink(missing_ok=True)
    (here / ".service").unlink(missing_ok=True)
'''

LISTENER = r'''
import os, signal, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
worker = None

def stop(*_):
    if worker is not None:
        worker.terminate()
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
with open(os.path.join(root, "listener.pid"), "w") as handle:
    handle.write(str(os.getpid()))
print("Listening for Jobs", flush=True)
while True:
    busy = os.path.exists(os.path.join(root, ".fake-busy"))
    if busy and worker is None:
        worker = subprocess.Popen([sys.executable, os.path.join(here, "Runner.Worker"),
                                   "spawnclient"])
    elif not busy and worker is not None:
        worker.terminate()
        worker.wait()
        worker = None
    time.sleep(0.1)
'''

WORKER = r'''
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.2)
'''

HEALTH = r'''
echo "disk ok"
echo "gh token in env: ${GH_TOKEN:-none}"
echo "GH_TOKEN=ghp_abcdefghijklmnopqrstuvwxyz0123456789"
exit 0
'''


def _script(path: Path, body: str, shebang: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((shebang or f"#!{PY}") + "\n" + body.lstrip("\n"))
    path.chmod(0o755)
    return path


def write_bin(bin_dir: Path) -> Path:
    _script(bin_dir / "systemctl", SYSTEMCTL, shebang=f"#!{PY} -S")
    _script(bin_dir / "launchctl", LAUNCHCTL)
    _script(bin_dir / "health-check", HEALTH, shebang="#!/bin/sh")
    return bin_dir


def make_install(path: Path, version: str = "2.311.0", staged: tuple[str, ...] = ()) -> Path:
    """An unconfigured runner installation (what the release tarball unpacks)."""
    versioned = path / f"bin.{version}"
    _script(versioned / "Runner.Listener", LISTENER)
    _script(versioned / "Runner.Worker", WORKER)
    (path / "bin").symlink_to(f"bin.{version}")
    for extra in staged:
        (path / f"bin.{extra}").mkdir()
    _script(path / "config.sh", CONFIG_SH)
    _script(path / "svc.sh", SVC_SH)
    _script(path / "run.sh", f'exec "{PY}" "$(dirname "$0")/bin/Runner.Listener" run\n',
            shebang="#!/bin/sh")
    return path


def write_runner_file(path: Path, name: str, repo: str, agent_id: int = 1) -> None:
    data = {"agentId": agent_id, "agentName": name, "poolId": 1, "poolName": "Default",
            "serverUrl": "https://pipelines.example/abc",
            "gitHubUrl": f"https://github.com/{repo}", "workFolder": "_work"}
    # The real config.sh writes a BOM; discovery must cope.
    (path / ".runner").write_text(json.dumps(data, indent=2), encoding="utf-8-sig")


def user_unit(xdg: Path, runner_dir: Path, repo: str, name: str) -> str:
    unit = f"actions.runner.{repo.replace('/', '-')}.{name}.service"
    folder = xdg / "systemd" / "user"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / unit).write_text(f"[Service]\nExecStart={runner_dir / 'run.sh'}\n"
                               f"WorkingDirectory={runner_dir}\n")
    return unit


def calls(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_all_listeners(root: Path) -> None:
    """Test teardown: stop any fake listener still running under root (they are detached)."""
    import signal
    for pid_file in root.rglob("listener.pid"):
        try:
            pid = int(pid_file.read_text())
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass
    # A listener an action started as the test ended may not have written its pid file yet:
    # any process whose command line names a path under root is one of the test's own.
    proc = Path("/proc")
    if not proc.is_dir():
        return
    under = os.fsencode(root) + b"/"
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if under in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGTERM)
        except OSError:
            pass  # gone meanwhile, or not ours to read
