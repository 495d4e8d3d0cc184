"""End to end: agents and clients that speak ONLY the original tools' wire (tests/support/
field_agent.py) run constrained jobs through a real collector process: beacons with on_ac,
idle_s, load_1m, disk_free_gb and null, rows without iter, host rows with test.artifacts, suite
kinds xcuitest and maestro, report_to.github_status, payload read from the job detail, and
artifact uploads answered 201."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.collector import CollectorProcess
from tests.support.field_agent import FieldAgent, attestation

pytestmark = pytest.mark.slow

ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84"


def spec(job_id: str, **fields):
    return {"schema": 1, "job_id": job_id, "workload": "benchmark", "executor": "device",
            "backend": "synthetic", "targets": {"device_id": "iphone"},
            "params": {"prompt_tokens": 4, "gen_tokens": 2}, **fields}


@pytest.fixture
def collector(tmp_path: Path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LONG_POLL_S": "0.3"}).start()
    yield proc
    proc.stop()


def test_constrained_jobs_run_for_an_agent_of_the_original_wire(collector):
    phone = FieldAgent(collector.url, "iphone")
    phone.register(["benchmark"])
    phone.enqueue(spec("on-mains", constraints={"require_ac": True}))
    phone.enqueue(spec("quiet", constraints={"max_load": 1.0}))
    phone.enqueue(spec("unattended", constraints={"require_idle_s": 600}))

    # Every probe says it cannot tell: nothing is released (fail closed).
    phone.beacon()
    assert phone.poll() is None
    # On mains, busy and in use: only the job that asks for mains power goes.
    phone.beacon(on_ac=True, idle_s=30, load_1m=3.2, disk_free_gb=41.5)
    got = phone.poll()
    assert got is not None and got["job_id"] == "on-mains"
    assert phone.beacon(job_id="on-mains", on_ac=True, idle_s=30, load_1m=3.2)[
        "lease_renewed"] is True
    metrics = {"prefill_tok_s": 310.5, "decode_tok_s": 120.25, "ttft_ms": 14.2,
               "synthetic_rounds": 1000, "synthetic_digest": attestation()}
    reply = phone.post_row("on-mains", metrics=metrics, runner={"app": "ios-agent 3.1"})
    assert reply["status"] == "done" and reply["duplicate"] is False
    assert phone.poll() is None  # load 3.2 and idle 30 s: the others wait
    # The load drops (charging is not mains, and a null on_ac is unknown): the quiet job goes.
    phone.beacon(on_ac=None, charging=True, idle_s=30, load_1m=0.4)
    assert phone.poll()["job_id"] == "quiet"
    assert phone.post_row("quiet", metrics={"decode_tok_s": 99.0})["status"] == "done"
    # Idle long enough at last.
    phone.beacon(on_ac=False, idle_s=900, load_1m=0.4)
    assert phone.poll()["job_id"] == "unattended"
    assert phone.post_row("unattended", ok=False, error="thermal throttling")["status"] == \
        "failed"

    # payload: the row as the agent posted it (iter 0, since it sent none).
    [payload] = phone.payloads("on-mains")
    assert payload == {"schema": 1, "kind": "result", "job_id": "on-mains",
                       "device_id": "iphone", "iter": 0, "final": True, "ok": True,
                       "metrics": metrics, "artifacts": [], "runner": {"app": "ios-agent 3.1"}}
    assert payload["metrics"]["synthetic_digest"] == ATTESTATION
    [failed] = phone.payloads("unattended")
    assert failed["ok"] is False and failed["error"] == "thermal throttling"
    status, beacons = phone.http.get("/api/devices/iphone/beacons")
    assert status == 200 and beacons["beacons"][0]["on_ac"] is None


def test_host_jobs_and_specs_in_the_original_names(collector):
    ci = FieldAgent(collector.url, "ci-script")
    # The job-wide rows of the original's executors are filed as host:<name>.
    runner = FieldAgent(collector.url, "host:mac-mini", executor="mac-mini")
    assert runner.poll() is None  # the executor is known from its poll
    app = runner.upload(b"the app build")
    reply = ci.enqueue({
        "schema": 1, "job_id": "ui", "workload": "ui-test", "executor": "host",
        "app": {"name": "shop", "sha256": app, "platform": "ios"},
        "suite": {"kind": "xcuitest", "flows": "ShopUITests"},
        "report_to": {"github_status": "octo/shop@0123abc"}})
    assert reply["status"] == "queued"
    ci.enqueue({"schema": 1, "job_id": "publish", "workload": "archive", "executor": "host",
                "depends_on": ["ui"], "params": {"source": "${jobs.ui.artifact}"}})
    ci.enqueue({"schema": 1, "job_id": "flows", "workload": "ui-test", "executor": "host",
                "fanout": True, "suite": {"kind": "maestro", "flows": "flows/"}})

    claimed = runner.poll()
    assert claimed["job_id"] == "ui"
    # Shown in the neutral form.
    assert claimed["suite"] == {"kind": "native_bundle", "flows": "ShopUITests"}
    assert claimed["report_to"] == {"ci_status": "octo/shop@0123abc"}
    report = runner.upload(b"<testsuites tests='12' failures='0'/>")
    runner.post_row("ui", test={"artifacts": [report], "passed": 12, "failed": 0})
    publish = ci.http.get("/jobs/publish")[1]
    assert publish["status"] == "queued", publish["last_error"]
    assert publish["spec"]["params"]["source"] == report == hashlib.sha256(
        b"<testsuites tests='12' failures='0'/>").hexdigest()
    [payload] = ci.payloads("ui")
    assert payload["test"]["artifacts"] == [report] and payload["iter"] == 0

    child = ci.http.get("/jobs/flows--mac-mini")[1]
    assert child["spec"]["suite"]["kind"] == "flow_runner"
    assert child["spec"]["targets"] == {"executor": "mac-mini"}
