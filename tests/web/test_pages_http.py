"""The page routes over HTTP (no browser): shells, static files and their caching headers, the
legacy pages (no script, everything escaped, the page CSP), and refusals."""

from __future__ import annotations

import re
from typing import Any

from aiohttp.test_utils import TestClient

from fleet_min.collector.http import legacy
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


async def test_the_redirect_from_the_root_carries_the_security_headers(
        client: TestClient) -> None:
    """A redirect is raised, and was answered as raised: without the headers every other
    answer carries."""
    resp = await client.get("/", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/dash"
    for name in ("X-Frame-Options", "X-Content-Type-Options", "Referrer-Policy"):
        assert resp.headers.get(name), (name, dict(resp.headers))


async def test_runner_shell(client: TestClient) -> None:
    resp = await client.get("/runner")
    assert resp.status == 200
    text = await resp.text()
    assert "/runner/runner.js" in text and resp.headers["Content-Security-Policy"] == PAGE_CSP
    # No other site may frame it (a Start click must be the person's own, on this page), and it
    # has no inline script or handler for the policy to refuse.
    assert resp.headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in PAGE_CSP
    assert re.findall(r"<script[^>]*>", text) == [
        '<script type="module" src="' + await static_prefix(client, "/runner")
        + '/runner/runner.js">']
    assert not re.search(r"\son[a-z]+=", text)
    assert '<button id="start" type="button"' in text
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
    # Reordering characters are written out in text and read attributes, kept in links.
    cell = legacy.tag("td", "a\u202eb", title="c\u2067d", href="/x?q=e\u202ef")
    assert "a[U+202E]b" in cell and 'title="c[U+2067]d"' in cell and "e\u202ef" in cell


def test_legacy_values_read_as_text_not_data() -> None:
    from fleet_min.timeutil import parse_iso

    assert legacy.pairs({"device_id": "pi5", "pool": "sbc"}) == (
        '<span class="kv"><span><span class="k">device_id:</span> pi5</span>'
        '<span><span class="k">pool:</span> sbc</span></span>')
    assert legacy.pairs({}) is None and legacy.pairs(None) is None
    nested = legacy.value({"a": [1, {"b": None}]})
    assert nested == '<code>{&quot;a&quot;: [1, {&quot;b&quot;: null}]}</code>'  # data, marked so
    assert legacy.value(["phones", "nightly"]) == "phones, nightly"
    assert legacy.value(None) == legacy.esc(None) and legacy.value(True) == "yes"
    shown = legacy.metrics({"decode_tok_s": 12.5, "mem_method": None, "ok": False, "x": [1]})
    assert shown == "decode_tok_s=12.5 · mem_method=" + legacy.esc(None) + " · ok=no"
    assert "None" not in shown and "False" not in shown

    at = parse_iso("2026-01-01T00:03:00Z")
    assert legacy.short_time("2026-01-01T00:00:00.250000Z", at) == (
        '<time datetime="2026-01-01T00:00:00.250000Z" title="2026-01-01 00:00:00 UTC">'
        "3 min ago</time>")
    assert ">in 2.0 h<" in legacy.short_time("2026-01-01T02:03:00Z", at)
    assert ">just now<" in legacy.short_time("2026-01-01T00:03:00Z", at)
    assert legacy.short_time("not a time", at) == "not a time"
    assert legacy.short_sha("ab" * 32) == (
        f'<abbr title="{"ab" * 32}" class="sha">{"ab" * 6}\u2026</abbr>')


async def test_legacy_job_page_shows_its_spec_parts_as_lines(client: TestClient) -> None:
    await seed_evil(client)
    spec = job("j2", targets={"device_id": "d1"}, constraints={"min_battery_pct": 20},
               lease={"ttl_s": 900}, params={"prompt_tokens": 8, "gen_tokens": 4})
    assert (await client.post("/jobs", json=spec)).status == 201
    page = await (await client.get("/dash/legacy/jobs/j2")).text()
    dd = re.search(r"<dt>Targets</dt><dd>(.*?)</dd>", page)
    assert dd and dd.group(1) == ('<span class="kv"><span><span class="k">device_id:</span> d1'
                                  "</span></span>")
    for line in ("min_battery_pct:</span> 20", "ttl_s:</span> 900",
                 "gen_tokens:</span> 4", "prompt_tokens:</span> 8"):
        assert line in page, line
    outside_pre = re.sub(r"<pre>.*?</pre>", "", page, flags=re.S)
    assert "{&quot;" not in outside_pre and "None" not in outside_pre
