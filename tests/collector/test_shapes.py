"""Shapes the original collector's clients read: job list facets, artifact rows' disk state and
reference counts, download file names, simulator flags, job detail roles and timeline, and the
snooze in minutes. All over HTTP against a real collector."""

from __future__ import annotations

import hashlib
import json

from fleet_min.collector.jobs import views
from tests.support.collector import age_rows, edit_rows, job, registration, result_row


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def upload(client, data: bytes, name: str = "blob.bin") -> str:
    resp = await client.post("/artifacts", data=data, headers={
        "content-type": "application/octet-stream", "x-artifact-name": name})
    assert resp.status == 201, await resp.text()
    return (await resp.json())["sha256"]


async def claim(client, device_id: str) -> dict:
    resp = await client.get(f"/devices/{device_id}/next-job")
    assert resp.status == 200, resp.status
    return await resp.json()


# -- job list facets ------------------------------------------------------------------------------


async def test_job_list_reports_status_workload_and_pool_facets(client):
    await client.post("/devices/register", json=registration("d1", pools=["lab"]))
    await client.post("/jobs", json=job("a", targets={"pool": "lab"}))
    await client.post("/jobs", json=job("b", targets={"pool": "shelf"}))
    await client.post("/jobs", json=job("c", workload="self-check"))
    await claim(client, "d1")
    await client.post("/results", json=result_row("a", "d1", final=True, ok=True))

    everything = await (await client.get("/api/jobs")).json()
    assert everything["status_counts"]["done"] == 1
    assert everything["status_counts"]["queued"] == 2
    assert everything["status_counts"]["cancelled"] == 0  # every status named, zero or not
    assert everything["workloads"] == ["benchmark", "self-check"]
    assert everything["pools"] == ["lab", "shelf"]

    lab = await (await client.get("/api/jobs?pool=lab")).json()
    assert [(j["job_id"], j["pool"]) for j in lab["jobs"]] == [("a", "lab")]
    assert (await (await client.get("/api/jobs/b")).json())["pool"] == "shelf"

    # The counts follow the other filters but not the status one: the filter UI shows what
    # each status button would find.
    failed = await (await client.get("/api/jobs?status=failed&pool=lab")).json()
    assert failed["jobs"] == [] and failed["status_counts"]["done"] == 1
    assert failed["status_counts"]["queued"] == 0


# -- artifact rows and downloads ----------------------------------------------------------------


async def test_artifact_rows_say_on_disk_and_count_references(client, tmp_path):
    model = await upload(client, b"model bytes", "model.gguf")
    lonely = await upload(client, b"nobody names me")
    output = await upload(client, b"a report", "report.html")
    await client.post("/devices/register", json=registration("d1"))
    await client.post("/jobs", json=job("bench", model={"name": "m", "sha256": model}))
    await claim(client, "d1")
    await client.post("/results", json=result_row("bench", "d1", final=True, ok=True,
                                                  artifacts=[output, model]))
    (tmp_path / "data" / "artifacts" / lonely[:2] / lonely).unlink()  # lost behind our back

    rows = {a["sha256"]: a for a in (await (await client.get("/api/artifacts")).json())
            ["artifacts"]}
    # A closed job still counts as a reference (history), though it no longer holds the bytes.
    assert rows[model]["references"] == 1  # the spec and a result row of one job: one job
    assert rows[output]["references"] == 1
    assert rows[lonely]["references"] == 0
    assert rows[model]["on_disk"] is True and rows[lonely]["on_disk"] is False


async def test_download_filename_becomes_a_sanitised_content_disposition(client):
    digest = await upload(client, b"fake apk")
    named = await client.get(f"/artifacts/{digest}?filename=fleet-runner.apk")
    assert named.status == 200 and await named.read() == b"fake apk"
    assert named.headers["Content-Disposition"] == 'attachment; filename="fleet-runner.apk"'
    assert "Content-Disposition" not in (await client.get(f"/artifacts/{digest}")).headers

    evil = await client.get(f"/artifacts/{digest}", params={"filename": 'a"\r\nX-Evil: yes'})
    assert "X-Evil" not in evil.headers
    assert evil.headers["Content-Disposition"] == 'attachment; filename="aX-Evilyes"'
    climbing = await client.get(f"/artifacts/{digest}", params={"filename": "../../etc/passwd"})
    assert climbing.headers["Content-Disposition"] == 'attachment; filename="etcpasswd"'
    nothing = await client.get(f"/artifacts/{digest}", params={"filename": "\u00e9\u00e9/.."})
    assert nothing.status == 200 and "Content-Disposition" not in nothing.headers
    ranged = await client.get(f"/artifacts/{digest}?filename=x.apk", headers={"Range": "bytes=0-3"})
    assert ranged.status == 206 and ranged.headers["Content-Disposition"].endswith('"x.apk"')


# -- devices ----------------------------------------------------------------------------------


async def test_device_rows_say_whether_they_are_simulators(client):
    hardware = registration("R5CT1234", descriptor={"model": "Pixel 8", "os": "Android 14"})
    by_name = registration("iphone-sim-1", descriptor={"model": "arm64", "os": "ios-18.4"})
    by_model = registration("ab12", descriptor={"model": "iPhone 16 Simulator"})
    by_flag = registration("AB0637DA", descriptor={"model": "iPhone 16", "simulator": True})
    emulator = registration("emulator-5554", descriptor={"model": "sdk_gphone64"})
    for body in (hardware, by_name, by_model, by_flag, emulator):
        assert (await client.post("/devices/register", json=body)).status == 200
    flags = {d["device_id"]: d["simulator"] for d in
             (await (await client.get("/api/devices")).json())["devices"]}
    assert flags == {"R5CT1234": False, "iphone-sim-1": True, "ab12": True, "AB0637DA": True,
                     "emulator-5554": True}
    one = await (await client.get("/api/devices/iphone-sim-1")).json()
    assert one["simulator"] is True


async def test_device_list_offers_the_pool_facet(client):
    await client.post("/devices/register", json=registration("d1", pools=["phones", "lab"]))
    await client.post("/devices/register", json=registration("d2", pools=["lab"]))
    await client.patch("/api/devices/d2", json={"pools": ["bench"]})  # the override counts
    listing = await (await client.get("/api/devices")).json()
    assert listing["pools"] == ["bench", "lab", "phones"]


# -- job detail -------------------------------------------------------------------------------


async def test_job_detail_gives_artifact_roles_a_timeline_and_the_parent(client):
    model = await upload(client, b"weights", "model.gguf")
    report = await upload(client, b"report", "report.html")
    missing = "ab" * 32
    await client.post("/devices/register", json=registration("d1"))
    await client.post("/jobs", json=job("bench", model={"name": "m", "sha256": model},
                                        params={"input_sha256": missing}))
    await claim(client, "d1")
    await client.post("/results", json=result_row("bench", "d1", 1, metrics={"x": 1}))
    await client.post("/results", json=result_row("bench", "d1", final=True, ok=True,
                                                  artifacts=[report]))
    detail = await (await client.get("/api/jobs/bench")).json()
    roles = {a["sha256"]: (a["role"], a["in_store"]) for a in detail["artifacts"]}
    assert roles == {model: ("input", True), missing: ("input", False),
                     report: ("output", True)}
    named = {a["sha256"]: a["name"] for a in detail["artifacts"]}
    assert named[report] == "report.html" and named[missing] is None

    events = [e["event"] for e in detail["derived_timeline"]]
    assert events[0] == "created" and events[-1] == "done"
    assert events.index("claimed") < events.index("first result") < events.index("final result")
    times = [e["at"] for e in detail["derived_timeline"]]
    assert times == sorted(times) and all(t.endswith("Z") for t in times)
    assert detail["parent"] is None

    await client.post("/devices/register", json=registration("d2"))
    fan = await (await client.post("/jobs", json=job("fan", fanout=True))).json()
    child = (await (await client.get(f"/api/jobs/{fan['fanout'][0]}")).json())
    assert child["parent"] == "fan"


async def test_job_detail_carries_its_final_rows_and_its_newest_others_cut_down(client,
                                                                                db_path):
    """A job may hold a million rows of nearly a megabyte: the detail carries its final rows and
    its newest DETAIL_ROWS others, their bulky fields cut down as a listing's are, and says how
    many there are in all; every row still pages through /api/results."""
    await client.post("/devices/register", json=registration("d1"))
    await client.post("/jobs", json=job("long"))
    await claim(client, "d1")
    wide = {f"m{n}": "x" * 900 for n in range(200)}  # 180 KB of metrics
    resp = await client.post("/results", json=result_row("long", "d1", 1, metrics=wide))
    assert resp.status == 200, await resp.text()
    # The rest written straight into the file, as many posts would leave them.
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 2 UNION ALL SELECT i + 1 FROM n WHERE "
              "i < ?) INSERT INTO results (job_id, device_id, iter, attempt, workload, ok, final, "
              "preempted, metrics, artifacts, created_at) SELECT 'long', 'd1', i, 1, workload, 1, "
              "0, 0, '{\"n\": ' || i || '}', '[]', created_at + i FROM n, results "
              "WHERE results.iter = 1", (views.DETAIL_ROWS + 50,))
    await client.post("/results", json=result_row("long", "d1", 0, final=True, ok=True))
    detail = await (await client.get("/api/jobs/long")).json()
    rows = detail["results"]
    assert detail["results_total"] == views.DETAIL_ROWS + 51
    assert len(rows) == views.DETAIL_ROWS + 1
    assert [r["iter"] for r in rows] == [0, *range(51, views.DETAIL_ROWS + 51)]
    assert rows[0]["final"] is True and rows[0]["payload"]["final"] is True
    assert rows[1]["metrics"] == {"n": 51} and rows[1]["trimmed"] == []
    # The wide row is no longer among the newest; in /api/results it comes cut down too.
    assert 1 not in {r["iter"] for r in rows}
    pages = (await (await client.get("/api/results?job=long")).json())["pages"]
    listed = await (await client.get(f"/api/results?job=long&page={pages}")).json()
    wide_row = next(r for r in listed["results"] if r["iter"] == 1)
    assert wide_row["trimmed"] == ["metrics"] and len(json.dumps(wide_row)) < 100_000
    page = await (await client.get("/dash/legacy/jobs/long")).text()
    assert f"{views.DETAIL_ROWS + 1} of {views.DETAIL_ROWS + 51} rows" in page


# -- alerts -----------------------------------------------------------------------------------


async def test_snooze_in_minutes_must_be_at_least_one(client, db_path):
    await client.post("/devices/register", json=registration("d1"))
    await client.patch("/api/devices/d1", json={"name": "Pixel 7"})  # offline is for named ones
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    [alert_id] = (await (await client.post("/api/alerts/tick")).json())["opened"]
    zero = await client.post(f"/api/alerts/{alert_id}/snooze", json={"minutes": 0})
    assert zero.status == 400
    assert 'send {"duration_s": 0} to lift one' in (await zero.json())["error"]
    thirty = await client.post(f"/api/alerts/{alert_id}/snooze", json={"minutes": 30})
    assert thirty.status == 200 and (await thirty.json())["muted"] is True
