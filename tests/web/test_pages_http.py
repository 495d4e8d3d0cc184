"""The page routes over HTTP (no browser): shells, static files and their caching headers, the
legacy pages (no script, everything escaped, the page CSP), and refusals."""

from __future__ import annotations

import re
from typing import Any

from aiohttp.test_utils import TestClient

from fleet_min.collector import legacy
from fleet_min.http import PAGE_CSP
from tests.support.collector import beacon, job, registration, result_row

EVIL = '<img src=x onerror="alert(1)">'


async def static_prefix(client: TestClient, path: str = "/dash") -> str:
    resp = await client.get(path)
    found = re.search(r'src="(/static/[0-9a-f]+)/', await resp.text())
    assert found, "the shell names its static files"
    return found.group(1)


async def test_dash_shell_and_every_client_route_serve_the_same_page(client: TestClient) -> None:
    for path in ("/dash", "/dash/", "/dash/jobs/x%2Fy", "/dash/@col-1/devices", "/dash/nope"):
        resp = await client.get(path)
        assert resp.status == 200, path
        assert resp.content_type == "text/html"
        assert resp.headers["Content-Security-Policy"] == PAGE_CSP
        assert resp.headers["Cache-Control"] == "no-cache"
        text = await resp.text()
        assert '<script type="module" src="/static/' in text
        assert "onclick" not in text.lower() and "<script>" not in text  # no inline script
    root = await client.get("/", allow_redirects=False)
    assert root.status == 302 and root.headers["Location"] == "/dash"


async def test_static_files_are_immutable_under_the_build_and_revalidate_otherwise(
        client: TestClient) -> None:
    prefix = await static_prefix(client)
    resp = await client.get(prefix + "/dash/app.js")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/javascript")
    assert resp.headers["Cache-Control"] == "public, max-age=31536000, immutable"
    etag = resp.headers["ETag"]
    again = await client.get(prefix + "/dash/app.js", headers={"If-None-Match": etag})
    assert again.status == 304 and again.headers["ETag"] == etag
    old = await client.get("/static/0123456789abcdef/dash/app.js")
    assert old.status == 200 and old.headers["Cache-Control"] == "no-cache"
    for vendored in ("/vendor/preact/preact.module.js", "/vendor/preact/hooks.module.js",
                     "/vendor/htm/htm.module.js", "/vendor/uplot/uPlot.esm.js",
                     "/vendor/uplot/uPlot.min.css", "/runner/sha256.js", "/runner/worker.js"):
        assert (await client.get(prefix + vendored)).status == 200, vendored
    hooks = await (await client.get(prefix + "/vendor/preact/hooks.module.js")).text()
    assert 'from"./preact.module.js"' in hooks  # no bare specifier: no import map needed


async def test_static_refuses_paths_outside_the_served_folders(client: TestClient) -> None:
    prefix = await static_prefix(client)
    for path in ("/controlplane/app.js", "/dash/index.html", "/../collector/app.py",
                 "/dash/%2e%2e/%2e%2e/collector/app.py", "/dash/.hidden", "/vendor/nope.js"):
        resp = await client.get(prefix + path)
        assert resp.status == 404, path
        assert "error" in await resp.json()


async def test_runner_shell(client: TestClient) -> None:
    resp = await client.get("/runner")
    assert resp.status == 200
    text = await resp.text()
    assert "/runner/runner.js" in text and resp.headers["Content-Security-Policy"] == PAGE_CSP
    assert (await client.get("/favicon.svg")).content_type == "image/svg+xml"


async def seed_evil(client: TestClient) -> None:
    body = registration("d1", pools=[EVIL], capabilities=["benchmark"])
    assert (await client.post("/devices/register", json=body)).status == 200
    assert (await client.patch("/api/devices/d1", json={"name": EVIL, "notes": EVIL})).status == 200
    assert (await client.post("/results", json=beacon("d1", thermal=EVIL))).status == 200
    assert (await client.post("/jobs", json=job("j1", targets={"device_id": "d1"}))).status == 201
    claimed = await client.get("/devices/d1/next-job")
    assert claimed.status == 200
    row = result_row("j1", "d1", 0, ok=False, final=True, error=EVIL, metrics={"x": EVIL})
    assert (await client.post("/results", json=row)).status == 200


async def test_legacy_pages_have_no_script_and_escape_everything(client: TestClient) -> None:
    await seed_evil(client)
    pages = ["/dash/legacy", "/dash/legacy/devices", "/dash/legacy/devices/d1",
             "/dash/legacy/jobs", "/dash/legacy/jobs?status=failed&q=j", "/dash/legacy/jobs/j1",
             "/dash/legacy/results", "/dash/legacy/schedules", "/dash/legacy/alerts",
             "/dash/legacy/artifacts"]
    for path in pages:
        resp = await client.get(path)
        assert resp.status == 200, path
        assert resp.headers["Content-Security-Policy"] == PAGE_CSP
        text = await resp.text()
        assert text.startswith("<!doctype html>")
        assert "<script" not in text.lower(), path
        assert "<img" not in text, path
        assert 'onerror="' not in text, path
    detail = await (await client.get("/dash/legacy/jobs/j1")).text()
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in detail
    device = await (await client.get("/dash/legacy/devices/d1")).text()
    assert device.count("&lt;img") >= 3  # name, notes, pools, thermal


async def test_legacy_refusals_are_pages(client: TestClient) -> None:
    for path, status in (("/dash/legacy/jobs/nope", 404), ("/dash/legacy/devices/nope", 404),
                         ("/dash/legacy/jobs?status=bogus", 400), ("/dash/legacy/whatever", 404)):
        resp = await client.get(path)
        assert resp.status == status, path
        assert resp.content_type == "text/html"
        assert "<script" not in (await resp.text()).lower()
    css = await client.get("/dash/legacy/style.css")
    assert css.content_type == "text/css" and css.headers.get("ETag")


def test_markup_escapes_what_it_is_given() -> None:
    cell = legacy.tag("td", EVIL, title=EVIL)
    assert "<img" not in cell and cell.startswith("<td title=")
    joined = legacy.tag("p", "safe") + EVIL
    assert isinstance(joined, legacy.Markup) and "<img" not in joined
    assert "<img" not in (EVIL + legacy.tag("p", "x"))
    empty: list[Any] = []
    assert "Nothing" in legacy.table(("a",), empty, "Nothing here")
