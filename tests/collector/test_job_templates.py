"""Job templates over HTTP against a real collector: save, list, edit, delete, enqueue from one,
the refusals that change nothing, and the artifacts a template holds."""

from __future__ import annotations

import hashlib

import pytest

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
    ({"id": "t", "spec": "benchmark"}, "JSON object"),
])
async def test_save_refusals_are_400_and_store_nothing(api, body, words):
    resp = await api.post("/api/templates", json=body)
    assert resp.status == 400
    assert words in (await resp.json())["error"]
    assert await listed(api) == []


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
