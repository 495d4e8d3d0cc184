"""Job templates over HTTP against a real collector: save, list, edit, delete, enqueue from one,
the refusals that change nothing, and the artifacts a template holds."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest

from fleet_min.collector.automation import job_templates, schedules
from fleet_min.collector.jobs import queue
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate
from tests.support.collector import edit_rows, registration

SPEC = {"schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic",
        "params": {"prompt_tokens": 8, "gen_tokens": 8}, "targets": {"pool": "shelf"}}


@pytest.fixture
async def api(collector_factory):
    return await collector_factory()


async def save(api, template_id="bench", spec=None, name="Shelf bench", status=201):
    resp = await api.post("/api/templates", json={"id": template_id, "name": name,
                                                  "spec": spec or SPEC})
    assert resp.status == status, await resp.text()
    return await resp.json()


async def listed(api):
    resp = await api.get("/api/templates")
    assert resp.status == 200
    return (await resp.json())["templates"]


async def test_save_list_get_edit_delete(api):
    saved = await save(api)
    assert saved["ok"] is True and saved["id"] == "bench" and saved["name"] == "Shelf bench"
    assert saved["spec"] == SPEC and saved["workload"] == "benchmark"
    assert saved["created_at"].endswith("Z") and saved["updated_at"].endswith("Z")
    one = await (await api.get("/api/templates/bench")).json()
    assert one == {k: v for k, v in saved.items() if k != "ok"}
    assert [t["id"] for t in await listed(api)] == ["bench"]
    # Saving the same id again replaces its name and spec: 200.
    again = await save(api, spec={**SPEC, "params": {"prompt_tokens": 16}}, name="Bigger",
                       status=200)
    assert again["name"] == "Bigger" and again["spec"]["params"] == {"prompt_tokens": 16}
    edited = await api.patch("/api/templates/bench", json={"name": None})
    assert edited.status == 200
    assert (await edited.json())["name"] is None
    assert (await edited.json())["spec"]["params"] == {"prompt_tokens": 16}
    gone = await api.delete("/api/templates/bench")
    assert gone.status == 200 and await gone.json() == {"ok": True, "id": "bench",
                                                        "deleted": True}
    assert await listed(api) == []


@pytest.mark.parametrize(("body", "words"), [
    ({"id": "t", "spec": {**SPEC, "job_id": "x"}}, "must not carry job_id"),
    ({"id": "t"}, "spec is required"),
    ({"id": "-t", "spec": SPEC}, "id is required"),
    ({"spec": SPEC}, "id is required"),
    ({"id": "t", "spec": SPEC, "name": 5}, "name must be text"),
    ({"id": "t", "spec": SPEC, "name": "n" * 201}, "at most 200"),
    ({"id": "t", "spec": {"schema": 2, "workload": "x", "executor": "device"}}, "schema"),
    ({"id": "t", "spec": {**SPEC, "password": "hunter2"}}, "looks like a secret"),
    ({"id": "t", "spec": {**SPEC, "targets": {"match": "ram_mb >>> 4"}}}, "targets.match"),
    ({"id": "t", "spec": SPEC, "colour": "red"}, "not a template field"),
    ({"id": ".", "spec": SPEC}, "not . or .."),  # /api/templates/. is the listing
    ({"id": "t", "spec": "benchmark"}, "JSON object"),
])
async def test_save_refusals_are_400_and_store_nothing(api, body, words):
    resp = await api.post("/api/templates", json=body)
    assert resp.status == 400
    assert words in (await resp.json())["error"]
    assert await listed(api) == []


async def test_a_spec_past_the_template_bound_is_413_and_stores_nothing(api):
    """Every listing carries each spec whole: one past MAX_TEMPLATE_BYTES is refused on save
    and on edit, with what to do instead."""
    pad = "x" * schedules.MAX_TEMPLATE_BYTES
    big = {**SPEC, "params": {**SPEC["params"], "note": pad}}
    resp = await api.post("/api/templates", json={"id": "big", "spec": big})
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert f"at most {schedules.MAX_TEMPLATE_BYTES}" in error and "artifact" in error
    assert await listed(api) == []
    saved = await save(api)
    resp = await api.patch("/api/templates/bench", json={"spec": big})
    assert resp.status == 413
    assert (await listed(api))[0] == {k: v for k, v in saved.items() if k != "ok"}
    # Just within the bound is kept.
    room = schedules.MAX_TEMPLATE_BYTES - len(json.dumps({**SPEC, "params": {
        **SPEC["params"], "note": ""}}))
    fits = {**SPEC, "params": {**SPEC["params"], "note": "x" * room}}
    assert (await save(api, "fits", spec=fits))["spec"] == fits


async def test_a_collector_keeps_at_most_max_templates(api, db_path):
    await save(api, "t0000")
    # The rest written straight into the file, as many saves would leave them.
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
              "WHERE i < ?) INSERT INTO job_templates (id, name, spec, created_at, updated_at) "
              "SELECT printf('t%04d', i), name, spec, created_at, updated_at "
              "FROM n, job_templates WHERE job_templates.id = 't0000'",
              (job_templates.MAX_TEMPLATES - 1,))
    before = await listed(api)
    assert len(before) == job_templates.MAX_TEMPLATES
    resp = await api.post("/api/templates", json={"id": "one-more", "spec": SPEC})
    assert resp.status == 409
    error = (await resp.json())["error"]
    assert f"keeps {job_templates.MAX_TEMPLATES} job templates" in error
    assert "delete one" in error
    assert await listed(api) == before
    # Saving over one that exists is no new template, and deleting one makes room.
    await save(api, "t0001", name="Again", status=200)
    assert (await api.delete("/api/templates/t0002")).status == 200
    await save(api, "one-more")


async def test_edit_refusals_change_nothing(api):
    saved = await save(api)
    for body, status, words in [
            ({"spec": {**SPEC, "job_id": "x"}}, 400, "must not carry job_id"),
            ({"id": "renamed"}, 400, "not a template field"),
            ({}, 400, "nothing to change"),
            ({"name": ["x"]}, 400, "name must be text")]:
        resp = await api.patch("/api/templates/bench", json=body)
        assert resp.status == status, body
        assert words in (await resp.json())["error"]
    assert (await listed(api))[0] == {k: v for k, v in saved.items() if k != "ok"}


async def test_unknown_template_is_404_everywhere(api):
    for method, path in [("GET", "/api/templates/nope"), ("PATCH", "/api/templates/nope"),
                         ("DELETE", "/api/templates/nope"),
                         ("POST", "/api/templates/nope/enqueue")]:
        resp = await api.request(method, path, json={"name": "x"} if method == "PATCH" else {})
        assert resp.status == 404, (method, path)
        assert "nope" in (await resp.json())["error"]


async def test_enqueue_names_the_job_and_records_the_template(api):
    await save(api)
    resp = await api.post("/api/templates/bench/enqueue")
    assert resp.status == 201, await resp.text()
    made = await resp.json()
    assert made["ok"] is True and made["template_id"] == "bench" and made["status"] == "queued"
    assert made["job_id"].startswith("bench-") and len(made["job_id"]) == len("bench-") + 14
    job = await (await api.get(f"/jobs/{made['job_id']}")).json()
    assert job["template_id"] == "bench" and job["workload"] == "benchmark"
    named = await api.post("/api/templates/bench/enqueue", json={"job_id": "mine"})
    assert named.status == 201 and (await named.json())["job_id"] == "mine"
    # A job id that exists is 409 and enqueues nothing; a bad one is 400.
    assert (await api.post("/api/templates/bench/enqueue", json={"job_id": "mine"})).status == 409
    bad = await api.post("/api/templates/bench/enqueue", json={"job_id": "a b"})
    assert bad.status == 400
    assert (await api.post("/api/templates/bench/enqueue", json={"colour": 1})).status == 400
    jobs = await (await api.get("/api/jobs")).json()
    assert sorted(j["job_id"] for j in jobs["jobs"]) == sorted([made["job_id"], "mine"])
    # Deleting the template keeps its jobs.
    await api.delete("/api/templates/bench")
    assert (await api.get("/jobs/mine")).status == 200


async def test_a_template_of_a_workload_only_a_late_device_declares_is_enqueued(api):
    """The template's enqueue checks that a registered device declares its workload as
    POST /jobs does: past the devices a transaction reads (queue.CHECK_IN_TRANSACTION) the
    registry is read on a worker thread and the enqueue run again, with the same answers."""
    for i in range(queue.CHECK_IN_TRANSACTION + 8):
        resp = await api.post("/devices/register", json=registration(f"crowd-{i}",
                                                                       capabilities=["other"]))
        assert resp.status == 200
    late = registration("late", capabilities=["template-rare"])
    assert (await api.post("/devices/register", json=late)).status == 200
    await save(api, "rare", spec={"schema": 1, "workload": "template-rare",
                                  "executor": "device"})
    resp = await api.post("/api/templates/rare/enqueue", json={"job_id": "rare-1"})
    assert resp.status == 201, await resp.text()
    assert (await api.get("/jobs/rare-1")).status == 200
    # A fan-out's targets too, its job id made inside the transaction.
    await save(api, "rare-fan", spec={"schema": 1, "workload": "template-rare",
                                      "executor": "device", "fanout": True})
    resp = await api.post("/api/templates/rare-fan/enqueue")
    assert resp.status == 201, await resp.text()
    made = await resp.json()
    assert made["fanout"] == [f"{made['job_id']}--late"], made
    late["capabilities"] = ["something-else"]
    assert (await api.post("/devices/register", json=late)).status == 200
    resp = await api.post("/api/templates/rare/enqueue", json={"job_id": "rare-2"})
    assert resp.status == 422 and "'template-rare'" in (await resp.json())["error"]
    assert (await api.get("/jobs/rare-2")).status == 404


async def test_a_template_holds_the_artifacts_its_spec_names(api):
    data = b"model bytes for a template"
    sha = hashlib.sha256(data).hexdigest()
    resp = await api.post("/artifacts", data=data,
                          headers={"content-type": "application/octet-stream"})
    assert resp.status == 201
    await save(api, spec={**SPEC, "model": {"name": "m", "sha256": sha}})
    refused = await api.delete(f"/api/artifacts/{sha}")
    assert refused.status == 409
    assert "job template bench" in (await refused.json())["error"]
    await api.delete("/api/templates/bench")
    assert (await api.delete(f"/api/artifacts/{sha}")).status == 200


def test_a_template_enqueued_again_within_its_second_makes_another_job(tmp_path):
    """The default job id is the template and the second: the second enqueue within a second
    was refused with a 409 naming a job id the caller never chose. Real SQLite, one `now`."""
    conn = sqlite3.connect(tmp_path / "t.sqlite3", isolation_level=None)
    conn.row_factory = sqlite3.Row
    migrate(conn, MIGRATIONS)
    now = 1_790_000_000.0
    job_templates.put(conn, {"id": "bench", "spec": SPEC}, now, Effects())
    made = [job_templates.enqueue(conn, "bench", {}, now, Effects())["job_id"] for _ in range(3)]
    assert made == ["bench-20260921141320", "bench-20260921141320-2", "bench-20260921141320-3"]
    assert conn.execute("SELECT COUNT(*) FROM jobs WHERE template_id = 'bench'").fetchone()[0] == 3
    conn.close()
