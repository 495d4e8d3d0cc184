"""The dashboard's job templates (in the enqueue form), its add-a-device page and its schedule
editing, in headless Chromium against a live seeded collector. Screenshots go to
test-artifacts/screenshots/."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.browser import PHONE, SeededCollector, shot
from tests.support.collector import registration

pytestmark = pytest.mark.slow


def test_save_load_and_enqueue_templates_from_the_form(seeded: SeededCollector,
                                                        open_page: Callable[..., Any]) -> None:
    client = seeded.proc.client
    page = open_page(seeded.url + "/dash/jobs/new", wait="[data-template=sbc-bench]")
    page.fill("input[name=workload]", "self-check")
    page.fill("input[name=backend]", "")
    page.fill("input[name=pool]", "phones")
    page.fill("input[name=template_id]", "form-selfcheck")
    page.fill("input[name=template_name]", "Self-check of the phones")
    page.click("#save-template button[type=submit]")
    page.wait_for_selector("[data-template=form-selfcheck]")
    saved = client.get("/api/templates/form-selfcheck")[1]
    assert saved["name"] == "Self-check of the phones" and "job_id" not in saved["spec"]
    assert saved["spec"]["workload"] == "self-check"
    assert saved["spec"]["targets"] == {"pool": "phones"}
    # Loading a template puts its spec back into the form.
    page.click("[data-template=sbc-bench] button:has-text('Load')")
    page.wait_for_function("() => document.querySelector('input[name=pool]').value === 'sbc'")
    assert page.input_value("input[name=workload]") == "benchmark"
    assert page.input_value("input[name=prompt_tokens]") == "16"
    shot(page, "enqueue-templates")
    # Enqueue one as saved: the job page opens, and the job says which template made it.
    page.click("[data-template=form-selfcheck] button:has-text('Enqueue')")
    page.wait_for_url("**/dash/jobs/form-selfcheck-*")
    job_id = page.url.rsplit("/", 1)[1]
    assert client.get(f"/jobs/{job_id}")[1]["template_id"] == "form-selfcheck"
    # ?template= opens the form with it loaded.
    page.goto(seeded.url + "/dash/jobs/new?template=form-selfcheck")
    page.wait_for_function("() => document.querySelector('input[name=pool]').value === 'phones'")
    assert page.watch.errors == []


def test_add_a_device_shows_the_command_a_qr_code_and_who_arrives(
        seeded: SeededCollector, open_page: Callable[..., Any]) -> None:
    page = open_page(seeded.url + "/dash/devices", wait="#add-device")
    page.click("#add-device")
    page.wait_for_selector("#enroll-qr")
    page.wait_for_function("() => document.querySelector('#enroll-qr').naturalWidth > 0")
    url = page.inner_text("#enroll-url")
    assert url.startswith("http://")
    command = page.inner_text("section[aria-labelledby=enroll-agent] pre")
    assert command == (f"curl -fsSL {url}/agent/fleet_agent.py -o fleet_agent.py && "
                       f"python3 fleet_agent.py --collector {url}")
    page.wait_for_selector("#enroll-waiting")
    status, _ = seeded.proc.client.post("/devices/register",
                                        registration("new-on-the-shelf", pools=["sbc"]))
    assert status == 200
    page.wait_for_selector("#enroll-arrived >> text=new-on-the-shelf")
    shot(page, "enroll")
    phone = open_page(seeded.url + "/dash/devices/new", viewport=PHONE, wait="#enroll-qr")
    phone.wait_for_function("() => document.querySelector('#enroll-qr').naturalWidth > 0")
    box = phone.locator("#enroll-qr").bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    shot(phone, "enroll-phone")
    assert page.watch.errors == [] and phone.watch.errors == []


def test_add_a_device_offers_the_runner_build_with_its_hash_until_it_is_pinned(
        seeded: SeededCollector, open_page: Callable[..., Any]) -> None:
    """Uploads are open: an unpinned runner build is shown with its hash and a note saying
    anyone could have put it there; pinning it (approving it) takes the note away."""
    body = b"a runner build from the network"
    request = urllib.request.Request(
        seeded.url + "/artifacts", data=body, method="POST",
        headers={"Content-Type": "application/octet-stream",
                 "x-artifact-app": "fleet-runner-android", "x-artifact-build": "77"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        sha = json.loads(reply.read())["sha256"]
    page = open_page(seeded.url + "/dash/devices/new", wait="#runner-download")
    assert page.inner_text("#runner-sha") == sha
    assert "anyone who can reach" in page.inner_text("#runner-unapproved")
    status, _ = seeded.proc.client.post(f"/api/artifacts/{sha}/pin", {"reason": "runner 77"})
    assert status == 200
    page.wait_for_selector("#runner-unapproved", state="detached")
    assert page.inner_text("#runner-sha") == sha
    assert page.watch.errors == []


def test_edit_a_schedules_cron_and_template_in_place(seeded: SeededCollector,
                                                     open_page: Callable[..., Any]) -> None:
    client = seeded.proc.client
    status, _ = client.post("/api/schedules", {"id": "edit-me", "cron": "0 4 * * *", "template": {
        "schema": 1, "workload": "self-check", "executor": "device"}})
    assert status == 201
    page = open_page(seeded.url + "/dash/schedules/edit-me", wait="#edit-schedule")
    page.fill("#edit-schedule input[name=cron]", "30 5 * * 1-5")
    page.fill("#edit-schedule textarea[name=template]",
              '{"schema": 1, "workload": "self-check", "executor": "device", "fanout": true}')
    page.click("#edit-schedule button:has-text('Save changes')")
    page.wait_for_selector("section[aria-labelledby=sch-info] >> text=30 5 * * 1-5")
    record = client.get("/api/schedules/edit-me")[1]
    assert record["cron"] == "30 5 * * 1-5" and record["template"]["fanout"] is True
    # A refused change says why and changes nothing.
    page.fill("#edit-schedule input[name=cron]", "61 * * * *")
    page.click("#edit-schedule button:has-text('Save changes')")
    page.wait_for_selector(".toast.error >> text=minute")
    assert client.get("/api/schedules/edit-me")[1]["cron"] == "30 5 * * 1-5"
    shot(page, "schedule-edit")
    # The refused PATCH is logged by the browser as a failed request; nothing else may be.
    assert [e for e in page.watch.errors if "status of 400" not in e] == []
