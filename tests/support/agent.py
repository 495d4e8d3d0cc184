"""Helpers for the agent's tests: the agent module itself, fake tools on PATH, a tiny HTTP server,
and real collector and agent processes for the end-to-end tests."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.collector import free_port

REPO = Path(__file__).resolve().parents[2]
AGENT_FILE = REPO / "agent" / "fleet_agent.py"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def load_agent():
    spec = importlib.util.spec_from_file_location("fleet_agent", AGENT_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fleet_agent"] = module  # dataclass-free, but keeps tracebacks readable
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fa():
    """The agent file, imported the way a person runs it: as a standalone module."""
    return load_agent()


def make_tool(bin_dir: Path, name: str, body: str) -> Path:
    """An executable Python script on a fake PATH, standing in for adb, getprop, ..."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\nimport sys, os, json, time\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        target = root / rel.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    return root


@functools.lru_cache(maxsize=1)
def python38() -> str | None:
    """A real Python 3.8 (pyenv shims that only print an error do not count)."""
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("pyenv") else ""
    candidates = sorted(Path(root, "versions").glob("3.8*/bin/python3.8")) if root else []
    for path in [*candidates, shutil.which("python3.8")]:
        if path and subprocess.run([str(path), "--version"], capture_output=True).returncode == 0:
            return str(path)
    return None


# --- a small HTTP server for unit tests (artifact downloads, outbox posts) ---


class Recorder:
    def __init__(self) -> None:
        self.posts: list[dict] = []
        self.calls: list[tuple[str, str, object]] = []  # (method, path, JSON body) of each
        self.blobs: dict[str, bytes] = {}
        self.headers: dict[str, dict] = {}  # upload headers by sha256
        self.status = 200
        self.refuse_arrays = False  # answer an array body 400, like a collector before arrays
        self.missing: set[str] = set()  # paths answered 404, like a collector without them
        self.answers: dict[str, object] = {}  # GET path (query left out) -> its JSON answer

    def bodies(self, path: str) -> list:
        return [body for _, where, body in list(self.calls) if where == path]


@pytest.fixture
def http_stub():
    recorder = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, status, body: bytes, ctype="application/json"):
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            sha = self.path.rsplit("/", 1)[-1]
            recorder.calls.append(("GET", self.path, None))
            if self.path.startswith("/executor/next-job"):
                time.sleep(0.2)  # a long poll that ends with nothing to do
                self._reply(204, b"")
            elif self.path.split("?", 1)[0] in recorder.answers:
                answer = recorder.answers[self.path.split("?", 1)[0]]
                self._reply(200, json.dumps(answer).encode())
            elif self.path.startswith("/artifacts/") and sha in recorder.blobs:
                self._reply(200, recorder.blobs[sha], "application/octet-stream")
            else:
                self._reply(404, b'{"error": "no such artifact"}')

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path == "/artifacts":
                sha = hashlib.sha256(body).hexdigest()
                recorder.blobs[sha] = body
                recorder.headers[sha] = {k.lower(): v for k, v in self.headers.items()}
                self._reply(200, json.dumps({"sha256": sha}).encode())
                return
            recorder.calls.append(("POST", self.path, json.loads(body)))
            if self.path in recorder.missing:
                self._reply(404, b'{"error": "no such route"}')
                return
            if recorder.status != 200:
                self._reply(recorder.status, b'{"error": "refused by the stub"}')
                return
            parsed = json.loads(body)
            if isinstance(parsed, list) and recorder.refuse_arrays:
                self._reply(400, b'{"error": "the request body must be a JSON object"}')
                return
            recorder.posts.append(parsed)
            self._reply(200, b'{"ok": true}')

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    recorder.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield recorder
    server.shutdown()
    server.server_close()


# --- real processes for the end-to-end tests ---


def resolving_to_loopback(folder: Path, name: str) -> dict[str, str]:
    """The environment for a Python process in which `name` resolves to 127.0.0.1.

    This machine has no DNS server of ours and /etc/hosts is not ours to change, so a name for a
    collector (other than localhost and this host's own names, which every collector answers to)
    comes from a sitecustomize module that answers that one name in socket.getaddrinfo, the
    call every connection makes. Only the name lookup is replaced: the process, its HTTP and the
    Host header it sends are real.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import socket

        _lookup = socket.getaddrinfo


        def _getaddrinfo(host, *args, **kwargs):
            if isinstance(host, str) and host.lower() == {name.lower()!r}:
                host = "127.0.0.1"
            return _lookup(host, *args, **kwargs)


        socket.getaddrinfo = _getaddrinfo
        """))
    return {"PYTHONPATH": str(folder)}


def http_json(method: str, url: str, body: object = None, timeout: float = 10.0):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"content-type": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def http_bytes(url: str, timeout: float = 10.0) -> bytes:
    with _OPENER.open(url, timeout=timeout) as response:
        return response.read()


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class CollectorProc:
    """`python -m fleet_min collector` on a free port with short timers."""

    def __init__(self, tmp: Path, name: str = "c1") -> None:
        self.data = tmp / f"collector-{name}"
        self.data.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"collector-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> CollectorProc:
        env = dict(os.environ, FLEET_LONG_POLL_S="2", FLEET_SWEEP_S="1", PYTHONPATH=str(REPO))
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet_min", "collector", "--port", str(self.port),
             "--data", str(self.data), "--bind", "127.0.0.1"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(self._healthy, 20, what=f"collector on {self.url}")
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("collector exited:\n" + self.log_path.read_text()[-3000:])
        try:
            return http_json("GET", self.url + "/api/health", timeout=1)[0] == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def get(self, path: str):
        return http_json("GET", self.url + path)

    def post(self, path: str, body: object = None):
        return http_json("POST", self.url + path, body if body is not None else {})

    def enqueue(self, spec: dict) -> dict:
        status, reply = self.post("/jobs", spec)
        assert status in (200, 201), reply
        return reply

    def job(self, job_id: str) -> dict:
        status, reply = self.get(f"/jobs/{job_id}")
        assert status == 200, reply
        return reply

    def wait_status(self, job_id: str, statuses: tuple[str, ...], timeout: float = 30) -> dict:
        return wait_for(lambda: (lambda j: j if j["status"] in statuses else None)(
            self.job(job_id)), timeout, 0.1, f"job {job_id} to reach {statuses}")

    def results(self, job_id: str) -> list[dict]:
        rows, page = [], 1
        while True:
            status, reply = self.get(f"/api/results?job={job_id}&page={page}")
            assert status == 200, reply
            rows += reply["results"]
            if page >= reply.get("pages", 1):
                return rows
            page += 1

    def upload(self, data: bytes, name: str = "blob") -> str:
        request = urllib.request.Request(
            self.url + "/artifacts", data=data, method="POST",
            headers={"content-type": "application/octet-stream", "x-artifact-name": name})
        with _OPENER.open(request, timeout=10) as response:
            return json.loads(response.read())["sha256"]


class AgentProc:
    """`python agent/fleet_agent.py ...` as a real process with its own state directory."""

    def __init__(self, tmp: Path, collectors: list[str], device_id: str, *extra: str,
                 env: dict | None = None, python: str = sys.executable,
                 home: Path | None = None) -> None:
        # With `home`, the agent runs as a person starts it: HOME=home and no --state-dir, so
        # its state is the default ~/.fleet-agent.
        self.state = home / ".fleet-agent" if home else tmp / f"state-{device_id}"
        self.log_path = tmp / f"agent-{device_id}.log"
        self.argv = [python, str(AGENT_FILE), "--collector", ",".join(collectors),
                     *([] if home else ["--state-dir", str(self.state)]), "--beacon-s", "1",
                     "--retry-base-s", "0.2", "--retry-cap-s", "1", "--poll-timeout-s", "10",
                     "--log-level", "DEBUG", *extra]
        if "--executor" not in extra:
            self.argv += ["--device-id", device_id]
        self.env = dict(os.environ, **(env or {}))
        if home:
            self.env["HOME"] = str(home)
            self.env.pop("FLEET_AGENT_STATE", None)
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError("agent did not stop on SIGTERM:\n" + self.log()[-3000:]) from None

    def spooled(self) -> list[Path]:
        spool = self.state / "spool"
        return sorted(p for p in spool.glob("*.json")) if spool.exists() else []


@pytest.fixture
def procs(tmp_path):
    """Start collectors and agents; everything started is stopped at the end of the test."""
    started: list = []

    class Factory:
        def collector(self, name: str = "c1") -> CollectorProc:
            proc = CollectorProc(tmp_path, name).start()
            started.append(proc)
            return proc

        def agent(self, collectors, device_id: str, *extra: str, **kw) -> AgentProc:
            urls = [c.url if isinstance(c, CollectorProc) else c for c in collectors]
            proc = AgentProc(tmp_path, urls, device_id, *extra, **kw).start()
            started.append(proc)
            return proc

    yield Factory()
    for proc in reversed(started):
        if isinstance(proc, AgentProc):
            with contextlib.suppress(AssertionError):
                proc.stop()
        else:
            proc.stop()


# Fake host tools: real executables on PATH that behave like adb, xcrun, a flow runner and a
# headless browser for the subcommands the host executor uses.

PNG = b"\x89PNG\r\n\x1a\n"

FAKE_ADB = r"""
state_dir = os.environ["FAKE_ADB_DIR"]
args = sys.argv[1:]
with open(os.path.join(state_dir, "calls.jsonl"), "a") as log:
    log.write(json.dumps(args) + "\n")
devices = {"R5CT1234ABC": "SM_S911B", "emulator-5554": "sdk_gphone64_x86_64"}
if os.environ.get("FAKE_ADB_EMPTY"):
    devices = {}
if os.environ.get("FAKE_ADB_ONLY"):
    devices = {k: v for k, v in devices.items() if k == os.environ["FAKE_ADB_ONLY"]}
if args[:2] == ["devices", "-l"]:
    print("List of devices attached")
    for serial, model in devices.items():
        print(f"{serial:<22} device product:x model:{model} device:y transport_id:1")
    print()
    sys.exit(0)
if args[0] != "-s" or args[1] not in devices:
    print(f"adb: device '{args[1]}' not found", file=sys.stderr)
    sys.exit(1)
serial, rest = args[1], args[2:]
# One call at a time per device, as one adb server serialises a device's state here: the
# executor's presence thread reads getprop while a job writes the same JSON file.
import fcntl
device_lock = open(os.path.join(state_dir, serial + ".lock"), "a")
fcntl.flock(device_lock, fcntl.LOCK_EX)
state_file = os.path.join(state_dir, serial + ".state")
device_file = os.path.join(state_dir, serial + ".json")
logcat_file = os.path.join(state_dir, serial + ".logcat")
UI_TREE = (
    "<?xml version='1.0' encoding='UTF-8' standalone='yes' ?>\n<hierarchy rotation=\"0\">\n"
    '<node index="0" text="" resource-id="" class="android.widget.FrameLayout" '
    'content-desc="" clickable="false" bounds="[0,0][1080,2400]">\n'
    '<node index="0" text="Checkout" resource-id="com.example.shop:id/checkout" '
    'class="android.widget.Button" content-desc="" clickable="true" '
    'bounds="[100,200][700,400]" />\n'
    '<node index="1" text="" resource-id="com.example.shop:id/close" '
    'class="android.widget.ImageButton" content-desc="" clickable="true" '
    'bounds="[980,40][1050,110]" />\n'
    '<node index="2" text="" resource-id="com.example.shop:id/cart" '
    'class="android.widget.FrameLayout" content-desc="" clickable="true" '
    'bounds="[100,500][400,700]">\n'
    '<node index="0" text="Cart" resource-id="" class="android.widget.TextView" '
    'content-desc="" clickable="false" bounds="[120,520][380,680]" />\n</node>\n'
    '<node index="3" text="" resource-id="com.example.shop:id/email" '
    'class="android.widget.EditText" content-desc="" hint="Email" clickable="true" '
    'bounds="[100,800][1000,950]" />\n</node>\n</hierarchy>\n')
def replace(path, text):
    # Whole or not at all: another call of this fake (a job on the same device) or the test
    # may read the file meanwhile, and a file being rewritten in place reads empty.
    part = f"{path}.{os.getpid()}"
    with open(part, "w") as out:
        out.write(text)
    os.replace(part, path)
def set_state(value):
    replace(state_file, value)
def get_state():
    return open(state_file).read() if os.path.exists(state_file) else "cold"
def load():
    return json.load(open(device_file)) if os.path.exists(device_file) else {}
def save(device):
    replace(device_file, json.dumps(device))
def props():
    device = load()
    return {"ro.product.model": devices[serial].replace("_", " "),
            "ro.build.version.release": "14",
            "ro.build.version.sdk": os.environ.get("FAKE_ADB_SDK", "34"),
            "ro.build.characteristics": "emulator" if serial.startswith("emulator") else "phone",
            "ro.product.locale": "en-US", "persist.sys.locale": device.get("locale", ""),
            "sys.boot_completed": "1"}
def launches():
    counter = os.path.join(state_dir, serial + ".launches")
    return int(open(counter).read()) if os.path.exists(counter) else 0
def on_launch(n):
    # FAKE_CRASH_AT / FAKE_ANR_AT = "<serial>:<launch number>" puts that fault in the log.
    with open(logcat_file, "a") as log:
        if os.environ.get("FAKE_CRASH_AT") == f"{serial}:{n}":
            log.write("E/AndroidRuntime( 4242): FATAL EXCEPTION: main\n"
                      "E/AndroidRuntime( 4242): Process: com.example.shop, PID: 4242\n"
                      "E/AndroidRuntime( 4242): java.lang.IllegalStateException: cart is null\n")
        if os.environ.get("FAKE_ANR_AT") == f"{serial}:{n}":
            log.write("E/ActivityManager(  612): ANR in com.example.shop "
                      "(com.example.shop/.MainActivity)\n")
def battery():
    device = load()
    if device.get("unplugged"):  # the level falls by one each time it is read off the charger
        device["level"] = max(1, device.get("level", 80) - 1)
        save(device)
    plugged = "false" if device.get("unplugged") else "true"
    return ("Current Battery Service state:\n  AC powered: false\n  USB powered: " + plugged +
            "\n  Wireless powered: false\n  Max charging current: 500000\n  status: 2\n"
            "  health: 2\n  present: true\n  level: " + str(device.get("level", 80)) +
            "\n  scale: 100\n  voltage: 4100\n  temperature: 285\n  technology: Li-ion")
def launch(cmd):
    n = launches()
    open(os.path.join(state_dir, serial + ".launches"), "w").write(str(n + 1))
    on_launch(n + 1)
    base = {"cold": 800, "warm": 400, "hot": 150}.get(get_state(), 100)
    total = base + (n % 5) * 10
    print("Starting: Intent { cmp=" + cmd[-1] + " }")
    print("Status: ok")
    print("LaunchState: " + get_state().upper())
    print("Activity: " + cmd[-1])
    print(f"TotalTime: {total}")
    print(f"WaitTime: {total + 4}")
    print("Complete")
    set_state("foreground")
def meminfo(package):
    if not launches():
        print("No process found for: " + package)
        return
    print("Applications Memory Usage (in Kilobytes):")
    print(f"** MEMINFO in pid 4242 [{package}] **")
    print(f"           TOTAL PSS:    {50000 + 1500 * launches()}            "
          "TOTAL RSS:   120000       TOTAL SWAP PSS:       12")
def shell(cmd):
    device = load()
    if cmd[:3] == ["cmd", "package", "resolve-activity"]:
        print("priority=0 preferredOrder=0 match=0x108000 specificIndex=-1 isDefault=true")
        print(cmd[-1] + "/.MainActivity")
    elif cmd[:2] == ["am", "force-stop"]:
        set_state("cold")
    elif cmd[:3] == ["input", "keyevent", "KEYCODE_HOME"]:
        set_state("hot")
    elif cmd[:3] == ["input", "keyevent", "KEYCODE_BACK"]:
        set_state("warm")
    elif cmd[:2] == ["am", "start"] and "-W" in cmd:
        launch(cmd)
    elif cmd[:2] == ["am", "start"]:
        print("Starting: Intent { act=android.intent.action.VIEW }")
    elif cmd == ["getprop"]:
        for key, value in props().items():
            print(f"[{key}]: [{value}]")
    elif cmd[0] == "getprop":
        print(props().get(cmd[1], ""))
    elif cmd[:2] == ["setprop", "persist.sys.locale"]:
        if os.environ.get("FAKE_ADB_NO_ROOT"):
            print("Failed to set property 'persist.sys.locale'", file=sys.stderr)
            sys.exit(1)
        device["locale"] = cmd[2]
    elif cmd[:2] == ["setprop", "ctl.restart"]:
        device["restarts"] = device.get("restarts", 0) + 1
    elif cmd == ["pidof", "system_server"]:
        print(1000 + device.get("restarts", 0))
    elif cmd == ["pm", "path", "android"]:
        print("package:/system/framework/framework-res.apk")
    elif cmd[:3] == ["cmd", "locale", "get-app-locales"]:
        print(f"Locales for {cmd[3]} for user 0 are [{device.get('app_locale', '')}]")
    elif cmd[:3] == ["cmd", "locale", "set-app-locales"]:
        # the device's shell reads '' as an empty word: the app follows the system again
        device["app_locale"] = "" if cmd[5] == "''" else cmd[5]
    elif cmd[:4] == ["settings", "get", "system", "font_scale"]:
        print(device.get("font_scale", "null"))
    elif cmd[:4] == ["settings", "put", "system", "font_scale"]:
        device["font_scale"] = cmd[4]
    elif cmd[:4] == ["settings", "delete", "system", "font_scale"]:
        device.pop("font_scale", None)
    elif cmd[:2] == ["wm", "density"]:
        print("Physical density: 420")
    elif cmd[:2] == ["uiautomator", "dump"]:
        device["dump"] = cmd[2]
        print("UI hierchary dumped to: " + cmd[2])
    elif cmd[:2] == ["dumpsys", "battery"] and len(cmd) == 3:
        device["unplugged"] = cmd[2] == "unplug"
        device.setdefault("level", 80)
    elif cmd == ["dumpsys", "battery"]:
        print(battery())
        return
    elif cmd == ["cat", "/sys/class/power_supply/battery/current_now"]:
        print("-420000")
    elif cmd[:2] == ["dumpsys", "meminfo"]:
        meminfo(cmd[2])
    else:
        print("unknown shell command", file=sys.stderr)
        sys.exit(1)
    save(device)
if rest[0] == "install":
    import hashlib
    data = open(rest[-1], "rb").read()
    with open(os.path.join(state_dir, "installed.jsonl"), "a") as log:
        log.write(json.dumps([serial, hashlib.sha256(data).hexdigest(), rest[-1]]) + "\n")
    print("Performing Streamed Install")
    print("Success")
elif rest[:2] == ["exec-out", "screencap"]:
    device = load()
    sys.stdout.buffer.write(b"\x89PNG\r\n\x1a\n" + json.dumps(
        [serial, device.get("app_locale") or device.get("locale", ""),
         device.get("font_scale", "")]).encode())
elif rest[:2] == ["exec-out", "cat"]:
    if load().get("dump") != rest[2]:
        print(f"cat: {rest[2]}: No such file or directory")
        sys.exit(1)
    sys.stdout.write(UI_TREE)
elif rest[:2] == ["logcat", "-c"]:
    open(logcat_file, "w").close()
elif rest[:2] == ["logcat", "-d"]:
    print("--------- beginning of main")
    if os.path.exists(logcat_file):
        sys.stdout.write(open(logcat_file).read())
elif rest[0] == "shell":
    shell(rest[1:])
else:
    print("unknown adb command", file=sys.stderr)
    sys.exit(1)
"""

FAKE_XCRUN = r"""
state_dir = os.environ["FAKE_ADB_DIR"]
args = sys.argv[1:]
with open(os.path.join(state_dir, "xcrun.jsonl"), "a") as log:
    log.write(json.dumps(args) + "\n")
sim_file = os.path.join(state_dir, "sim.json")
import fcntl  # one call at a time, so a presence round never reads a half-written sim.json
sim_lock = open(os.path.join(state_dir, "sim.lock"), "a")
fcntl.flock(sim_lock, fcntl.LOCK_EX)
sim = json.load(open(sim_file)) if os.path.exists(sim_file) else {}
def save():
    json.dump(sim, open(sim_file, "w"))
def defaults(verb, key):
    if verb == "read":
        if key not in sim:
            print(f"The domain/default pair of (kCFPreferencesAnyApplication, {key}) does "
                  "not exist", file=sys.stderr)
            sys.exit(1)
        print('(\n    "' + sim[key] + '"\n)')
    elif verb == "write":
        sim[key] = args[-1]
    elif verb == "delete":
        sim.pop(key, None)
    save()
if args[:4] == ["simctl", "list", "-j", "devices"]:
    print(json.dumps({"devices": {"com.apple.CoreSimulator.SimRuntime.iOS-17-2": [
        {"udid": "5A1B-SIM", "name": "iPhone 15", "state": "Booted", "isAvailable": True}]}}))
elif args[:2] == ["simctl", "install"]:
    if not os.path.isfile(os.path.join(args[3], "Info.plist")):
        print("An error was encountered processing the command: not an app bundle",
              file=sys.stderr)
        sys.exit(2)
elif args[:2] == ["simctl", "launch"]:
    sim["running"] = args[3]
    save()
    print(args[3] + f": {os.getppid()}")
elif args[:2] == ["simctl", "terminate"]:
    sim.pop("running", None)
    save()
elif args[:2] == ["simctl", "io"] and args[3] == "screenshot":
    open(args[4], "wb").write(b"\x89PNG\r\n\x1a\n" + json.dumps(
        [args[2], sim.get("AppleLanguages", ""), sim.get("content_size", "large")]).encode())
    print("Wrote screenshot to: " + args[4])
elif args[:2] == ["simctl", "ui"] and args[3] == "content_size":
    if len(args) == 5:
        sim["content_size"] = args[4]
        save()
    else:
        print(sim.get("content_size", "large"))
elif args[:2] == ["simctl", "spawn"] and args[3:5] == ["launchctl", "list"]:
    # The app's process: the executor that runs this fake (a real process ps can read).
    print("PID\tStatus\tLabel")
    print("-\t0\tcom.apple.Preferences")
    if sim.get("running") and not os.environ.get("FAKE_SIM_CRASH"):
        print(f"{os.getppid()}\t0\tUIKitApplication:{sim['running']}[a1b2][rb-legacy]")
elif args[:2] == ["simctl", "spawn"] and args[3] == "defaults":
    defaults(args[4], args[6])
else:
    sys.exit(2)
"""

FAKE_FLOW_RUNNER = r"""
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if os.environ.get("FAKE_ADB_DIR"):
    with open(os.path.join(os.environ["FAKE_ADB_DIR"], "flows.jsonl"), "a") as log:
        log.write(json.dumps(sys.argv[1:]) + "\n")
if "--hierarchy" in args:  # a simulator's UI tree, in Maestro's shape
    close = {"attributes": {"accessibilityText": "", "text": "", "resource-id": "close",
                            "bounds": "[350,50][380,80]", "clickable": "true"}, "children": []}
    buy = {"attributes": {"accessibilityText": "Buy now", "bounds": "[20,600][370,660]",
                          "clickable": "true"}, "children": []}
    json.dump({"attributes": {"bounds": "[0,0][393,852]"}, "children": [close, buy]},
              open(args["--hierarchy"], "w"))
    sys.exit(0)
if args["--flows"] == "flows/":  # checkout is flaky: it fails on the 1st, 3rd ... run
    runs = os.path.join(os.environ.get("FAKE_ADB_DIR", "."), "suite-runs")
    run = (int(open(runs).read()) if os.path.exists(runs) else 0) + 1
    open(runs, "w").write(str(run))
    flows = [{"name": "login", "ok": True, "duration_ms": 1200},
             {"name": "checkout", "ok": run % 2 == 0, "duration_ms": 900,
              "error": None if run % 2 == 0 else "Pay button not found"},
             {"name": "logout", "ok": True, "duration_ms": 300}]
else:  # one flow file: it starts the app (as a real flow does) and passes unless named broken
    import shutil
    import subprocess
    adb = shutil.which("adb")
    if args["--platform"] == "android" and adb:
        subprocess.run([adb, "-s", args["--device"], "shell", "am", "start", "-W", "-n",
                        "com.example.shop/.MainActivity"], capture_output=True, check=False)
    name = os.path.basename(args["--flows"])
    flows = [{"name": name, "ok": "broken" not in name, "duration_ms": 250,
              "error": None if "broken" not in name else "Assertion failed: Cart is visible"}]
with open(args["--report"], "w") as fh:
    json.dump({"device": args["--device"], "flows": flows}, fh)
sys.exit(0 if all(f["ok"] for f in flows) else 1)
"""

FAKE_CHROMIUM = r"""
shot = [a for a in sys.argv if a.startswith("--screenshot=")]
if shot:
    open(shot[0].split("=", 1)[1], "wb").write(b"\x89PNG\r\n\x1a\nchromium")
    print("written screenshot")
elif "--dump-dom" in sys.argv:
    print("<html><head></head><body>Hello shelf</body></html>")
else:
    sys.exit(2)
"""

# Android's bundletool and apksigner, Xcode's xcodebuild, macOS's ioreg: archive and drain.

FAKE_BUNDLETOOL = r"""
import zipfile
with open(os.path.join(os.environ["FAKE_ADB_DIR"], "bundletool.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
if sys.argv[1] != "build-apks":
    sys.exit(2)
args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
password = open(args["--ks-pass"].split("file:", 1)[1]).read()
if password != os.environ.get("FAKE_KS_PASS", "s3cret") or not os.path.isfile(args["--ks"]):
    print("[BT:1.15.6] Error: Incorrect keystore password.", file=sys.stderr)
    sys.exit(1)
with zipfile.ZipFile(args["--output"], "w") as apks:
    apks.writestr("toc.pb", "table of contents")
    name = "universal.apk" if args.get("--mode") == "universal" else "splits/base-master.apk"
    apks.writestr(name, open(args["--bundle"], "rb").read())
"""

FAKE_APKSIGNER = r"""
with open(os.path.join(os.environ["FAKE_ADB_DIR"], "apksigner.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
password = open(args["--ks-pass"].split("file:", 1)[1]).read()
if password != os.environ.get("FAKE_KS_PASS", "s3cret"):
    print("Failed to load signer: keystore password was incorrect", file=sys.stderr)
    sys.exit(1)
open(args["--out"], "wb").write(open(sys.argv[-1], "rb").read() + b"signed")
"""

FAKE_XCODEBUILD = r"""
with open(os.path.join(os.environ["FAKE_ADB_DIR"], "xcodebuild.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
args, words = {}, sys.argv[2:]
for number, word in enumerate(words):  # -flag value, or a -flag alone
    if word.startswith("-"):
        following = words[number + 1] if number + 1 < len(words) else "-"
        args[word] = True if following.startswith("-") else following
plist = open(args["-exportOptionsPlist"]).read()
key = open(args["-authenticationKeyPath"]).read()
if sys.argv[1] != "-exportArchive" or "<key>teamID</key>" not in plist or \
        not key.startswith("-----BEGIN PRIVATE KEY"):
    print("error: exportArchive: No signing certificate found", file=sys.stderr)
    sys.exit(70)
app = os.path.basename(args["-archivePath"]).replace(".xcarchive", "")
open(os.path.join(args["-exportPath"], app + ".ipa"), "wb").write(b"PK ipa of " + app.encode())
print("** EXPORT SUCCEEDED **")
"""

FAKE_IOREG = r"""
state = os.path.join(os.environ["FAKE_ADB_DIR"], "mac-battery")
level = int(open(state).read()) if os.path.exists(state) else 91
open(state, "w").write(str(level - 2))
print("+-o AppleSmartBattery  <class AppleSmartBattery, id 0x100000a2f, registered>")
print("    {")
print(f'      "CurrentCapacity" = {level}')
print('      "MaxCapacity" = 100')
print('      "Temperature" = 3012')
print('      "Amperage" = -1250')
print('      "ExternalConnected" = ' + ("Yes" if os.environ.get("FAKE_MAC_ON_AC") else "No"))
print('      "IsCharging" = No')
print("    }")
"""


# --- running one device job in-process, rows going to a stub collector (device workloads) ---


def device_runtime(fa, tmp_path: Path, *flags: str, root: Path | None = None,
                   path: str | None = None):
    """A device-mode Runtime whose tools are looked up on `path` (default tmp_path/bin only)."""
    cfg = fa.parse_args(["--collector", "http://127.0.0.1:9", "--state-dir",
                         str(tmp_path / "state"), "--device-id", "unit-1", *flags])
    here = fa.Probe(root=str(root or tmp_path / "empty-root"),
                    env={"PATH": path or str(tmp_path / "bin")}, system="Linux",
                    machine="aarch64")
    return fa.Runtime(cfg, here)


def host_runtime(fa, tmp_path: Path, bin_dir: Path, *flags: str, name: str = "bench-host"):
    """A host-mode Runtime (executor `name`) whose tools are looked up in bin_dir only."""
    cfg = fa.parse_args(["--collector", "http://127.0.0.1:9", "--state-dir",
                         str(tmp_path / "state"), "--executor", "host", "--name", name, *flags])
    return fa.Runtime(cfg, fa.Probe(env={"PATH": str(bin_dir)}))


def job_context(fa, runtime, url: str, spec: dict):
    """The context a claimed job runs in: a device job as device unit-1, a host job as the
    executor."""
    executor = "host" if runtime.mode == "host" else "device"
    reporter = runtime.reporter_id if executor == "host" else "unit-1"
    return fa.JobContext(runtime, fa.Collector(url), {"schema": 1, "executor": executor, **spec},
                         reporter)


def run_job(fa, runtime, url: str, spec: dict):
    """(context, final result) of one job run through Runtime.execute."""
    ctx = job_context(fa, runtime, url, spec)
    return ctx, runtime.execute(ctx)


class JobThread(threading.Thread):
    """A job running in the background, for workloads that run until they are stopped."""

    def __init__(self, fa, runtime, url: str, spec: dict) -> None:
        super().__init__(daemon=True)
        self.ctx = job_context(fa, runtime, url, spec)
        self.runtime = runtime
        self.result: dict | None = None

    def run(self) -> None:
        self.result = self.runtime.execute(self.ctx)

    def finish(self, timeout: float = 20) -> dict:
        self.join(timeout)
        assert not self.is_alive(), "the job did not stop"
        assert self.result is not None
        return self.result


def zip_of(files: dict[str, bytes]) -> bytes:
    """A zip archive holding `files` (name -> bytes)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for name, data in files.items():
            bundle.writestr(name, data)
    return buffer.getvalue()


def device_job(job_id: str, workload: str, backend: str | None = None, **fields) -> dict:
    """A device job spec of `workload` (and `backend`), with any other fields given."""
    spec = {"schema": 1, "job_id": job_id, "workload": workload, "executor": "device"}
    if backend:
        spec["backend"] = backend
    spec.update(fields)
    return spec


class WebSite:
    """A local web server with fixed pages: path -> (status, body, headers); it counts hits."""

    def __init__(self, pages: dict, tls_context=None) -> None:
        self.pages = pages
        self.hits: list[str] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                site.hits.append(self.path)
                status, body, headers = site.pages.get(self.path, (404, b"not here", {}))
                self.send_response(status)
                for name, value in {"content-length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls_context is not None:
            self.server.socket = tls_context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.port = self.server.server_address[1]
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Trickle:
    """A web page that never finishes: its status line and headers (a body of 100 MB), then a
    byte of the body every `pause` seconds, or none at all when `pause` is None."""

    def __init__(self, pause: float | None) -> None:
        self.requests = 0
        self.closing = threading.Event()
        page = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                page.requests += 1
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", "100000000")
                self.end_headers()
                with contextlib.suppress(OSError):  # the agent hung up
                    self.wfile.flush()
                    while not page.closing.wait(pause or 0.05):
                        if pause is not None:
                            self.wfile.write(b"<")
                            self.wfile.flush()
                self.close_connection = True

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trickle():
    """trickle(pause) starts a Trickle page; every one started is closed after the test."""
    started: list[Trickle] = []

    def start(pause: float | None = 0.2) -> Trickle:
        page = Trickle(pause)
        started.append(page)
        return page

    yield start
    for page in started:
        page.close()


@pytest.fixture
def website():
    """website(pages) starts a WebSite; every one started is closed after the test."""
    started: list[WebSite] = []

    def start(pages: dict, tls_context=None) -> WebSite:
        site = WebSite(pages, tls_context)
        started.append(site)
        return site

    yield start
    for site in started:
        site.close()


def self_signed_cert(directory: Path) -> tuple[Path, Path] | None:
    """(certificate, key) for 127.0.0.1 made with the openssl tool, or None without it."""
    if not shutil.which("openssl"):
        return None
    cert, key = directory / "cert.pem", directory / "key.pem"
    result = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)], capture_output=True, timeout=60)
    return (cert, key) if result.returncode == 0 else None
