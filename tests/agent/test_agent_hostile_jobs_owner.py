"""End-to-end: jobs from whoever can POST /jobs, refused by the agent for its owner's sake.

A real collector process and real agent processes: a host executor with fake adb, flow runner,
apksigner, bundletool and xcodebuild on its PATH, and a device agent with fake go and cargo (and
the machine's own git) building a repository its owner listed. Each attack uses only what a LAN
neighbour of an open collector has: POST /artifacts and POST /jobs.

- archive signs only for the apps its credential item lists ("apps"), and an item without the
  list signs nothing;
- build's task words run only the compile and test subcommands, fetch no module@version and
  write nothing outside the checkout; the default go task builds;
- flow names (params.flow, a11y steps, suite.flows) stay inside the job's directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.agent import (
    FAKE_ADB,
    FAKE_APKSIGNER,
    FAKE_BUNDLETOOL,
    FAKE_FLOW_RUNNER,
    FAKE_XCODEBUILD,
    make_tool,
    wait_for,
    zip_of,
)

pytestmark = pytest.mark.slow

SECRET = "s3cret"  # the keystore password the fakes expect; never in a row or an error


APK = zip_of({"AndroidManifest.xml": b"attacker manifest", "classes.dex": b"ATTACKER PAYLOAD"})
AAB = zip_of({"BundleConfig.pb": b"cfg", "base/manifest/AndroidManifest.xml": b"<m/>"})
XCARCHIVE = zip_of({"Shop.xcarchive/Info.plist": b"<plist/>",
                    "Shop.xcarchive/Products/Applications/Shop.app/Shop": b"bin"})


def final_row(collector, job_id: str) -> dict:
    row = next(r for r in collector.results(job_id) if r["final"])
    return row.get("payload") or row


def finished(collector, job_id: str) -> dict:
    return collector.wait_status(job_id, ("done", "failed"), 90)


def logged(folder: Path, name: str) -> list[list[str]]:
    """The argv of each run of a fake tool that logs to FOLDER/NAME.jsonl."""
    path = folder / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def host_job(job_id: str, workload: str, **fields) -> dict:
    return {"schema": 1, "job_id": job_id, "workload": workload, "executor": "host", **fields}


def start_host(procs, collector, tmp_path: Path) -> Path:
    """A host executor whose devices and tools are fakes; their logs go to the folder returned."""
    bin_dir, logs = tmp_path / "host-bin", tmp_path / "host-tools"
    logs.mkdir()
    for name, body in {"adb": FAKE_ADB, "fleet-flow-runner": FAKE_FLOW_RUNNER,
                       "apksigner": FAKE_APKSIGNER, "bundletool": FAKE_BUNDLETOOL,
                       "xcodebuild": FAKE_XCODEBUILD}.items():
        make_tool(bin_dir, name, body)
    procs.agent([collector], "host", "--executor", "host", "--name", "owner-mac",
                env={"FAKE_ADB_DIR": str(logs), "FAKE_KS_PASS": SECRET,
                     "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"})
    return logs


# --- archive: a credential item signs only what its owner bound it to ---


def credential(state: Path, account: str, item: dict) -> Path:
    folder = state / "credentials"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{account}.json"
    path.write_text(json.dumps(item))
    path.chmod(0o600)
    return path


def test_archive_signs_only_the_apps_its_credential_item_lists(procs, tmp_path):
    collector = procs.collector()
    state = tmp_path / "state-host"  # the executor's --state-dir (AgentProc's naming)
    keystore = tmp_path / "release.jks"
    keystore.write_bytes(b"the owner's release keystore")
    keys = {"keystore": str(keystore), "keystore_password": SECRET, "key_alias": "release"}
    release = credential(state, "release", dict(keys, apps=["shop"]))
    bare = credential(state, "bare", keys)
    credential(state, "asc", {"apps": ["shop"], "team_id": "ABCDE12345", "api_key_id": "KEY1",
                              "api_issuer_id": "69a6de70-0000", "api_key_p8":
                              "-----BEGIN PRIVATE KEY-----\nMIGT\n-----END PRIVATE KEY-----\n"})
    logs = start_host(procs, collector, tmp_path)
    apk, aab, xcarchive = (collector.upload(data, name) for data, name in (
        (APK, "evil.apk"), (AAB, "evil.aab"), (XCARCHIVE, "evil.zip")))
    refused = [
        host_job("evil-apk", "archive", params={"source": apk, "app": "evil",
                                                "account": "release", "build": "9.9.9"}),
        host_job("evil-aab", "archive", params={"source": aab, "app": "evil",
                                                "account": "release"}),
        host_job("evil-name", "archive", app={"name": "evil", "build": "1"},
                 params={"source": apk, "account": "release"}),
        host_job("evil-ios", "archive", params={"source": xcarchive, "app": "evil",
                                                "account": "asc", "method": "ad-hoc"}),
        host_job("no-apps", "archive", params={"source": apk, "app": "shop",
                                               "account": "bare"}),
    ]
    for spec in refused:
        collector.enqueue(spec)
    status = {spec["job_id"]: finished(collector, spec["job_id"]) for spec in refused}
    # nothing signed, nothing published, no secret in a row
    assert logged(logs, "apksigner") == [] and logged(logs, "bundletool") == []
    assert logged(logs, "xcodebuild") == []
    assert collector.get("/api/artifacts?app=evil")[1]["artifacts"] == []
    for job_id in ("evil-apk", "evil-aab", "evil-name", "evil-ios"):
        error = status[job_id]["last_error"]
        assert status[job_id]["status"] == "failed", (job_id, status[job_id])
        assert "'evil' is not one of them" in error and '"apps"' in error, error
    assert str(release) in status["evil-apk"]["last_error"]
    assert status["no-apps"]["status"] == "failed"
    error = status["no-apps"]["last_error"]
    assert "lists no apps, so it signs nothing" in error and '"apps"' in error, error
    assert str(bare) in error
    for spec in refused:
        assert SECRET not in json.dumps(collector.results(spec["job_id"]))

    # the app the item lists still signs and publishes
    collector.enqueue(host_job("shop", "archive", params={"source": apk, "app": "shop",
                                                          "account": "release",
                                                          "build": "2.0.1"}))
    assert finished(collector, "shop")["status"] == "done"
    assert len(logged(logs, "apksigner")) == 1
    listed = collector.get("/api/artifacts?app=shop&platform=android")[1]["artifacts"]
    assert [a.get("build") for a in listed] == ["2.0.1"]
    assert SECRET not in json.dumps(collector.results("shop"))


# --- build: task words that fetch, run or write elsewhere ---

FAKE_GO = r"""
with open(os.environ["FAKE_BUILD_LOG"], "a") as log:
    log.write(json.dumps(["go", *sys.argv[1:]]) + "\n")
args = sys.argv[1:]
if args[:1] == ["build"]:  # the "binary" goes where -o says, as go puts it
    out = args[args.index("-o") + 1] if "-o" in args else "app.bin"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    open(out, "wb").write(b"built by go\n")
"""

FAKE_CARGO = r"""
with open(os.environ["FAKE_BUILD_LOG"], "a") as log:
    log.write(json.dumps(["cargo", *sys.argv[1:]]) + "\n")
"""


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def start_builder(procs, collector, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A device agent that may build one repository (go.mod, Cargo.toml, and `out`: a link to
    a folder outside the checkout); (repository, the fakes' log, that outside folder)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    repo = tmp_path / "repo"
    (repo / "cmd" / "app").mkdir(parents=True)
    (repo / "go.mod").write_text("module example.com/app\n\ngo 1.21\n")
    (repo / "cmd" / "app" / "main.go").write_text("package main\n\nfunc main() {}\n")
    (repo / "Cargo.toml").write_text('[package]\nname = "app"\nversion = "0.1.0"\n')
    (repo / "out").symlink_to(outside)
    for args in (("init", "-q", "-b", "main"), ("config", "user.email", "t@example.com"),
                 ("config", "user.name", "t"), ("add", "-A"), ("commit", "-qm", "one")):
        git(*args, cwd=repo)
    allowed = tmp_path / "build-repos"
    allowed.write_text(f"{repo}\n")
    bin_dir, log = tmp_path / "dev-bin", tmp_path / "build-tools.jsonl"
    make_tool(bin_dir, "go", FAKE_GO)
    make_tool(bin_dir, "cargo", FAKE_CARGO)
    procs.agent([collector], "builder", "--build-repos", str(allowed),
                env={"FAKE_BUILD_LOG": str(log),
                     "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    wait_for(lambda: "build:go" in (collector.get("/api/devices/builder")[1].get(
        "capabilities") or []), 30, what="the builder to declare build:go")
    return repo, log, outside


def build_job(job_id: str, repo: Path, kind: str, task: str | None, app: str = "app.bin"
              ) -> dict:
    params = {"repo": str(repo), "ref": "main", "kind": kind, "app": app}
    if task is not None:
        params["task"] = task
    return {"schema": 1, "job_id": job_id, "workload": "build", "executor": "device",
            "backend": kind, "params": params}


def tool_runs(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_build_refuses_subcommands_that_fetch_and_run_code(procs, tmp_path):
    collector = procs.collector()
    repo, log, _ = start_builder(procs, collector, tmp_path)
    jobs = {"go-run": ("go", "run github.com/attacker/implant@v1.0.0", "may not hold @"),
            "go-run-local": ("go", "run ./cmd/app", "must start with one of the go "
                                                    "subcommands build, test, vet"),
            "go-install": ("go", "install example.com/tool", "must start with one of the go"),
            "go-get": ("go", "build example.com/x@latest", "may not hold @"),
            "cargo-install": ("cargo", "install attacker-crate", "must start with one of the "
                                                                 "cargo subcommands build, "
                                                                 "test, check")}
    for job_id, (kind, task, _) in jobs.items():
        collector.enqueue(build_job(job_id, repo, kind, task))
    status = {job_id: finished(collector, job_id) for job_id in jobs}
    assert tool_runs(log) == []  # neither go nor cargo ever ran
    for job_id, (_, _, sentence) in jobs.items():
        assert status[job_id]["status"] == "failed", (job_id, status[job_id])
        assert sentence in status[job_id]["last_error"], (job_id, status[job_id]["last_error"])
        assert status[job_id]["last_error"].startswith("params.task ")


def test_build_output_stays_inside_the_checkout(procs, tmp_path):
    collector = procs.collector()
    repo, log, outside = start_builder(procs, collector, tmp_path)
    escape = outside / "escaped-bin"
    deep = "cmd/" + "../" * 40 + str(escape).lstrip("/")
    jobs = {"o-up": ("build -o ../x", "params.task may name paths only inside the checkout"),
            "o-deep": (f"build -o {deep}", "params.task may name paths only inside the checkout"),
            "o-abs": (f"build -o {escape}", "params.task may name paths only inside the checkout"),
            "o-link": ("build -o out/escaped-bin ./cmd/app", "leads outside the checkout"),
            "pkg-up": ("build ../../elsewhere", "params.task may name paths only inside")}
    for job_id, (task, _) in jobs.items():
        collector.enqueue(build_job(job_id, repo, "go", task, app="out/escaped-bin"))
    status = {job_id: finished(collector, job_id) for job_id in jobs}
    assert not escape.exists() and list(outside.iterdir()) == []  # nothing written out there
    assert tool_runs(log) == []
    for job_id, (_, sentence) in jobs.items():
        assert status[job_id]["status"] == "failed", (job_id, status[job_id])
        assert sentence in status[job_id]["last_error"], (job_id, status[job_id]["last_error"])


def test_the_default_go_task_and_plain_builds_are_accepted(procs, tmp_path):
    collector = procs.collector()
    repo, log, _ = start_builder(procs, collector, tmp_path)
    jobs = [build_job("go-default", repo, "go", None),
            build_job("go-o", repo, "go", "build -trimpath -o bin/app ./cmd/app", app="bin/app"),
            build_job("go-test", repo, "go", "test ./...", app="go.mod"),
            build_job("cargo-check", repo, "cargo", "check --locked", app="Cargo.toml")]
    for spec in jobs:
        collector.enqueue(spec)
    for spec in jobs:
        status = finished(collector, spec["job_id"])
        assert status["status"] == "done", (spec["job_id"], status["last_error"])
    assert tool_runs(log) == [["go", "build", "./..."],
                              ["go", "build", "-trimpath", "-o", "bin/app", "./cmd/app"],
                              ["go", "test", "./..."], ["cargo", "check", "--locked"]]
    assert final_row(collector, "go-default")["commit"]


# --- flows: a flow name stays inside the job's directory ---

BAD_FLOWS = ["../../../cache/flow.apk", "flows/../../credentials/release.json", "..",
             "/etc/passwd", "-debug-output=/tmp/x", "--flows"]


def test_flow_names_in_params_stay_inside_the_job(procs, tmp_path):
    collector = procs.collector()
    logs = start_host(procs, collector, tmp_path)
    shop = {"name": "shop", "platform": "android"}
    jobs = []
    for number, flow in enumerate(BAD_FLOWS):
        jobs.append(host_job(f"soak-{number}", "app-soak", app=shop,
                             targets={"device_id": "R5CT1234ABC"},
                             params={"app_id": "com.example.shop", "flow": flow,
                                     "duration_s": 1, "interval_s": 1}))
        jobs.append(host_job(f"shots-{number}", "locale-shots",
                             targets={"device_id": "R5CT1234ABC"},
                             params={"locales": ["de-DE"], "flow": flow, "settle_s": 0}))
        jobs.append(host_job(f"a11y-{number}", "a11y-audit",
                             targets={"device_id": "emulator-5554"},
                             params={"steps": [{"name": "cart", "flow": flow}],
                                     "settle_s": 0}))
    for spec in jobs:
        collector.enqueue(spec)
    status = {spec["job_id"]: finished(collector, spec["job_id"]) for spec in jobs}
    assert logged(logs, "flows") == []  # the flow runner never ran
    for job_id, job_status in status.items():
        assert job_status["status"] == "failed", (job_id, job_status)
        assert job_status["last_error"].startswith("params.flow must be a flow file inside the "
                                                   "job's directory"), job_status["last_error"]

    # a flow inside the job's directory still runs
    collector.enqueue(host_job("soak-ok", "app-soak", app=shop,
                               targets={"device_id": "R5CT1234ABC"},
                               params={"app_id": "com.example.shop", "flow": "flows/browse.yaml",
                                       "duration_s": 1, "interval_s": 1}))
    assert finished(collector, "soak-ok")["status"] == "done"
    assert [argv[argv.index("--flows") + 1] for argv in logged(logs, "flows")] == \
        ["flows/browse.yaml"]


def test_suite_flows_stay_inside_the_job(procs, tmp_path):
    collector = procs.collector()
    logs = start_host(procs, collector, tmp_path)
    shop = {"name": "shop", "platform": "android"}
    jobs = [host_job(f"ui-{number}", "ui-test", app=shop, targets={"device_id": "R5CT1234ABC"},
                     suite={"kind": "flow_runner", "flows": flow})
            for number, flow in enumerate(BAD_FLOWS)]
    for spec in jobs:
        collector.enqueue(spec)
    status = {spec["job_id"]: finished(collector, spec["job_id"]) for spec in jobs}
    assert logged(logs, "flows") == []  # the suite tool never ran
    for job_id, job_status in status.items():
        assert job_status["status"] == "failed", (job_id, job_status)
        assert job_status["last_error"].startswith("suite.flows must be a flow file inside the "
                                                   "job's directory"), job_status["last_error"]

    collector.enqueue(host_job("ui-ok", "ui-test", app=shop, targets={"device_id": "R5CT1234ABC"},
                               suite={"kind": "flow_runner", "flows": "flows/"}))
    finished(collector, "ui-ok")
    assert [argv[argv.index("--flows") + 1] for argv in logged(logs, "flows")] == ["flows/"]


def test_a_name_with_a_trailing_line_break_is_refused(procs, tmp_path):
    """The agent's name patterns read the whole value: `^...$` with match() also takes a name
    followed by a line break ("main\\n"), which then reached git and the tools as an argument."""
    collector = procs.collector()
    repo, log, _ = start_builder(procs, collector, tmp_path)
    jobs = {"ref-newline": ({"ref": "main\n"}, "params.ref must be a branch, tag or commit"),
            "app-newline": ({"app": "app.bin\n"}, "params.app ")}
    for job_id, (change, _) in jobs.items():
        spec = build_job(job_id, repo, "go", None)
        spec["params"].update(change)
        collector.enqueue(spec)
    status = {job_id: finished(collector, job_id) for job_id in jobs}
    assert tool_runs(log) == []  # go never ran
    for job_id, (_, sentence) in jobs.items():
        assert status[job_id]["status"] == "failed", (job_id, status[job_id])
        assert status[job_id]["last_error"].startswith(sentence), status[job_id]["last_error"]
