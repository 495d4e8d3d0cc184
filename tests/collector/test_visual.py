"""Visual review over HTTP against a real collector: screenshot rows become a matrix of
suite x page x profile; accepting a capture makes it the baseline; captures are judged new,
pass or diverged by their pixels."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from fleet_min.collector.artifacts import visual
from fleet_min.collector.http.visual import REVIEW
from tests.support.collector import edit_rows, job, result_row
from tests.support.images import palette_png, png_bytes, png_chunk, with_stripe

URL = "http://shop.test/pricing?plan=pro"
SUITE, PAGE = "shop.test", "/pricing?plan=pro"


async def upload(client, data: bytes, name: str = "shot.png") -> str:
    resp = await client.post("/artifacts", data=data, headers={
        "content-type": "application/octet-stream", "x-artifact-name": name})
    assert resp.status == 201, await resp.text()
    return (await resp.json())["sha256"]


async def shots_run(client, job_id: str, shots: list[tuple[str, bytes | None]],
                    workload: str = "web-shots", **spec) -> list[str | None]:
    """A screenshot job as the agent's host executor runs it: claimed by executor `mac`, a row
    per profile (its PNG its artifact), then the final row. Returns the captures' hashes."""
    spec.setdefault("targets", {"url": URL})
    assert (await client.post("/jobs", json=job(job_id, workload, "host", **spec))).status == 201
    claimed = await client.get("/executor/next-job?name=mac")
    assert (await claimed.json())["job_id"] == job_id
    hashes: list[str | None] = []
    for number, (profile, image) in enumerate(shots, 1):
        sha = await upload(client, image) if image is not None else None
        hashes.append(sha)
        row = result_row(job_id, "mac", number, executor="mac", ok=sha is not None,
                         browser=profile, artifacts=[sha] if sha else [],
                         error=None if sha else "Chromium could not screenshot")
        assert (await client.post("/results", json=row)).status == 200
    await client.post("/results", json=result_row(job_id, "mac", 0, executor="mac", final=True,
                                                  ok=True))
    return hashes


async def get(client, path: str, status: int = 200):
    resp = await client.get(path)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def accept(client, sha: str, page: str = PAGE, profile: str = "chromium",
                 suite: str = SUITE, status: int = 201):
    resp = await client.post("/api/visual/baselines/accept", json={
        "suite": suite, "page": page, "profile": profile, "sha256": sha, "job_id": "run-1"})
    assert resp.status == status, await resp.text()
    return await resp.json()


def by_profile(matrix) -> dict[str, dict]:
    return {cell["profile"]: cell for cell in matrix["cells"]}


async def test_captures_become_new_then_pass_or_diverged_against_the_baseline(client, db_path):
    picture = png_bytes(40, 20)
    [first, missing] = await shots_run(client, "run-1", [("chromium", picture),
                                                          ("android-device", None)])
    assert missing is None
    assert await get(client, "/api/visual/suites") == {"suites": [SUITE], "truncated": False}
    matrix = await get(client, f"/api/visual/matrix?suite={SUITE}")
    assert matrix["latest"]["job_id"] == "run-1"
    assert matrix["pages"] == [PAGE] and matrix["profiles"] == ["chromium", "android-device"]
    cells = by_profile(matrix)
    assert cells["chromium"]["status"] == "new" and cells["chromium"]["sha256"] == first
    assert cells["chromium"]["baseline_sha256"] is None
    assert cells["android-device"]["status"] == "missing"

    accepted = await accept(client, first)
    assert accepted["sha256"] == first and accepted["accepted_at"].endswith("Z")
    listed = await get(client, f"/api/visual/baselines?suite={SUITE}")
    assert [(b["page"], b["profile"], b["sha256"]) for b in listed["baselines"]] == [
        (PAGE, "chromium", first)]

    # The same pixels in other bytes (RGB, no alpha) pass; a stripe of 4 of 40 columns is
    # 10 % of the pixels, over the 0.1 % threshold.
    same = png_bytes(40, 20, alpha=False)
    [second] = await shots_run(client, "run-2", [("chromium", same)])
    cell = by_profile(await get(client, f"/api/visual/matrix?suite={SUITE}"))["chromium"]
    assert second != first
    assert (cell["status"], cell["diff_pct"], cell["baseline_sha256"]) == ("pass", 0.0, first)
    [third] = await shots_run(client, "run-3", [("chromium", png_bytes(40, 20, with_stripe(4)))])
    matrix = await get(client, f"/api/visual/matrix?suite={SUITE}")
    cell = by_profile(matrix)["chromium"]
    assert (cell["status"], cell["diff_pct"], cell["sha256"]) == ("diverged", 10.0, third)
    assert [h["job_id"] for h in cell["history"]] == ["run-2", "run-1"]
    assert [r["job_id"] for r in matrix["runs"]] == ["run-3", "run-2", "run-1"]
    # A looser threshold lets the same difference pass; the comparison is kept, not redone.
    loose = by_profile(await get(client, f"/api/visual/matrix?suite={SUITE}&threshold=15"))
    assert loose["chromium"]["status"] == "pass"
    with sqlite3.connect(db_path) as conn:
        kept = conn.execute("SELECT baseline, capture, diff_pct FROM visual_diffs "
                            "ORDER BY diff_pct").fetchall()
    assert kept == [(first, second, 0.0), (first, third, 10.0)]


async def test_accepting_replaces_the_pointer_and_keeps_baselines_out_of_collection(client):
    old = await upload(client, png_bytes(8, 8))
    new = await upload(client, png_bytes(8, 8, with_stripe(2)))
    await accept(client, old)
    replaced = await accept(client, new)
    assert replaced["replaced"] == old
    listed = await get(client, "/api/visual/baselines")
    assert [b["sha256"] for b in listed["baselines"]] == [new]  # one slot, never duplicates

    records = {a["sha256"]: a for a in (await get(client, "/api/artifacts"))["artifacts"]}
    assert records[new]["baseline"] is True and records[old]["baseline"] is False
    candidates = {a["sha256"] for a in
                  (await get(client, "/api/artifacts/gc-candidates"))["artifacts"]}
    assert new not in candidates and old in candidates
    refused = await client.delete(f"/api/artifacts/{new}")
    assert refused.status == 409
    dropped = await client.post(f"/api/artifacts/{new}/baseline", json={"accepted": False})
    assert dropped.status == 409
    assert f"visual baseline of {SUITE}/{PAGE} (chromium)" in (await dropped.json())["error"]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"suite": "s", "page": "p", "profile": "c", "sha256": "0" * 64}, 404, "no artifact"),
    ({"suite": "s", "page": "p", "profile": "c", "sha256": "XYZ"}, 400, "64 lowercase hex"),
    ({"page": "p", "profile": "c", "sha256": "0" * 64}, 400, "suite is required"),
    ({"suite": "s", "page": "p\n", "profile": "c", "sha256": "0" * 64}, 400, "control"),
    ({"suite": "s", "page": "p", "profile": "x" * 201, "sha256": "0" * 64}, 400, "profile"),
    ({"suite": "s", "page": "p", "profile": "c", "sha256": "0" * 64, "pinned": True}, 400,
     "pinned is not a field"),
    ([], 400, "JSON object"),
])
async def test_accept_refusals_change_nothing(client, body, status, words):
    resp = await client.post("/api/visual/baselines/accept", json=body)
    assert resp.status == status
    assert words in (await resp.json())["error"]
    assert (await get(client, "/api/visual/baselines")) == {"baselines": []}


@pytest.mark.parametrize(("query", "words"), [
    ("", "suite is required"), ("?suite=s&runs=0", "runs must be"),
    ("?suite=s&runs=26", "runs must be"), ("?suite=s&runs=9999999999", "runs must be"),
    ("?suite=s&threshold=nan", "threshold"), ("?suite=s&threshold=-1", "threshold"),
])
async def test_matrix_query_refusals(client, query, words):
    body = await get(client, f"/api/visual/matrix{query}", status=400)
    assert words in body["error"]


async def test_an_unknown_suite_has_an_empty_matrix(client):
    matrix = await get(client, "/api/visual/matrix?suite=nothing")
    assert matrix["latest"] is None and matrix["cells"] == []


async def test_a_screenshot_job_whose_url_is_not_one_leaves_the_views_answering(client):
    """targets.url is any string to the spec's check; `http://[oops/` made urlsplit raise on
    every read of the suites and the matrix while the job was among the newest."""
    resp = await client.post("/jobs", json=job("w1", workload="web-shots", executor="host",
                                               targets={"url": "http://[oops/"}))
    assert resp.status == 201, await resp.text()
    suites = await get(client, "/api/visual/suites")
    assert isinstance(suites["suites"], list)
    await get(client, "/api/visual/matrix?suite=web-shots")


async def test_a_capture_that_is_not_a_png_is_an_error_cell(client):
    baseline = await upload(client, png_bytes(8, 8))
    await accept(client, baseline, page="/", suite="site.test")
    await shots_run(client, "odd", [("chromium", b"<html>not a picture</html>")],
                    targets={"url": "http://site.test/"})
    cell = by_profile(await get(client, "/api/visual/matrix?suite=site.test"))["chromium"]
    assert cell["status"] == "error" and "not a PNG image" in cell["note"]


async def nightly_shots(client, job_id: str) -> str:
    """A web-shots job of suite nightly claimed by executor `mac`, with chromium's baseline of
    page home accepted: the SHA-256 of the capture its rows report."""
    capture = await upload(client, b"bytes an executor compared")
    baseline = await upload(client, b"its baseline")
    await accept(client, baseline, suite="nightly", page="home", profile="chromium")
    await client.post("/jobs", json=job(job_id, "web-shots", "host",
                                        targets={"url": URL}, suite={"flows": "nightly"}))
    await client.get("/executor/next-job?name=mac")
    return capture


def shot_row(job_id: str, capture: str, profile: str, pct: object) -> dict:
    """The row an executor files for one browser's capture of page home."""
    return result_row(job_id, f"web:{profile}", 1, executor="mac", ok=pct is None,
                      shot={"suite": "nightly", "page": "home", "profile": profile,
                            "sha256": capture},
                      metrics={"diff_pct": pct} if pct is not None else {})


async def test_rows_with_a_shot_block_name_their_own_slot(client):
    """The original's executors stamp each row with shot {suite, page, profile, sha256} and
    may report the difference they measured themselves (metrics.diff_pct)."""
    capture = await nightly_shots(client, "orig")
    for profile, pct in (("chromium", 4.2), ("webkit", None)):
        row = shot_row("orig", capture, profile, pct)
        assert (await client.post("/results", json=row)).status == 200
    assert "nightly" in (await get(client, "/api/visual/suites"))["suites"]
    cells = by_profile(await get(client, "/api/visual/matrix?suite=nightly"))
    assert (cells["chromium"]["status"], cells["chromium"]["diff_pct"]) == ("diverged", 4.2)
    assert (cells["webkit"]["status"], cells["webkit"]["baseline_sha256"]) == ("new", None)


@pytest.mark.parametrize(("workload", "spec", "row", "slot"), [
    ("web-shots", {"targets": {"url": "https://a.test/x"}, "params": {"page": "landing"}},
     {"browser": "android-device", "serial": "R5CT", "device_id": "mac"},
     ("a.test", "landing", "android-device@R5CT")),
    ("web-shots", {"targets": {"url": "https://a.test"}, "params": {"suite": "marketing"}},
     {"browser": "chromium"}, ("marketing", "/", "chromium")),
    ("locale-shots", {"app": {"name": "shop"}}, {"locale": "de-DE", "device_id": "emulator-5554"},
     ("shop", "de-DE", "emulator-5554")),
    ("locale-shots", {"params": {"app_id": "com.example.shop"}},
     {"locale": "ja-JP", "device_id": "R5CT"}, ("com.example.shop", "ja-JP", "R5CT")),
    ("a11y-audit", {}, {"step": "checkout", "variant": "largest", "device_id": "R5CT"},
     ("a11y-audit", "checkout", "largest@R5CT")),
    ("a11y-audit", {}, {"device_id": "R5CT"}, None),  # not a screen row
])
def test_row_slots_follow_the_documented_convention(workload, spec, row, slot):
    suite = visual.job_suite(workload, spec, None)
    assert visual.row_slot(workload, spec, suite, row) == slot


def test_a_schedule_names_the_suite_when_nothing_else_does():
    assert visual.job_suite("locale-shots", {}, "nightly-locales") == "nightly-locales"


async def test_a_reported_difference_past_a_floats_range_is_no_figure(client, db_path):
    """A 400-digit diff_pct is valid JSON, but no float holds it: refused at the door now, and
    one a database from before kept leaves the matrix answering, the cell reading as if no
    difference had been reported."""
    capture = await nightly_shots(client, "huge")
    refused = await client.post("/results", json=shot_row("huge", capture, "chromium", 10 ** 400))
    assert refused.status == 400 and "more than 308 digits" in (await refused.json())["error"]
    row = shot_row("huge", capture, "chromium", 987_654_321_987_654)
    assert (await client.post("/results", json=row)).status == 200
    edit_rows(db_path, "UPDATE results SET metrics = replace(metrics, ?1, ?2), "
                       "extra = replace(extra, ?1, ?2)", ("987654321987654", "1" + "0" * 400))
    cell = by_profile(await get(client, "/api/visual/matrix?suite=nightly"))["chromium"]
    assert cell["diff_pct"] is None, cell


async def test_a_shot_named_by_something_else_than_a_hash_is_one_cell_not_the_matrix(client):
    """A row's shot.sha256 is its executor's word: "not-a-hash" made every read of the suite's
    matrix a 400 (the store refused it as an artifact's name) until a newer run came, so one
    claimant of any screenshot job could blank any suite's review page."""
    await nightly_shots(client, "liar")
    row = shot_row("liar", "not-a-hash", "chromium", None)
    row["shot"]["diff_sha256"] = "../../etc/passwd"
    assert (await client.post("/results", json=row)).status == 200
    matrix = await get(client, "/api/visual/matrix?suite=nightly")
    cell = by_profile(matrix)["chromium"]
    assert (cell["status"], cell["sha256"], cell["diff_sha256"]) == ("missing", None, None)
    assert "not a SHA-256" in cell["note"]


async def test_a_capture_wider_than_a_screen_is_an_error_cell_and_never_decoded(client, db_path):
    """A 40,000,000 x 1 palette PNG (39 KB) passed the pixel limit, and pypng's row of tuples
    took one matrix request to 2.3 GB. A row past 16,384 pixels is refused from the header, and
    the sentence is kept with the pair like any comparison's outcome."""
    wide = palette_png(16_385, 1)
    baseline = await upload(client, wide, "base.png")
    await accept(client, baseline)
    [capture] = await shots_run(client, "wide", [("chromium", wide + b"\0")])
    cell = by_profile(await get(client, f"/api/visual/matrix?suite={SUITE}"))["chromium"]
    assert cell["status"] == "error", cell
    assert cell["note"] == ("the baseline is 16,385 pixels wide, wider than the 16,384 this "
                            "compares")
    with sqlite3.connect(db_path) as conn:
        kept = conn.execute("SELECT capture, diff_pct, width, error FROM visual_diffs").fetchall()
    assert kept == [(capture, None, None, cell["note"])]


async def test_one_request_reads_at_most_its_share_of_rows_and_says_so(client, monkeypatch):
    """200 jobs of 5,000 rows, each read whole and parsed on the loop, took one request some
    25 s. A request reads ROWS_PER_REQUEST rows at most."""
    monkeypatch.setattr(visual, "ROWS_PER_REQUEST", 2, raising=False)
    picture = png_bytes(4, 4)
    await shots_run(client, "old", [("chromium", picture), ("firefox", picture)],
                    targets={"url": "http://old.test/"})
    await shots_run(client, "new", [("chromium", picture), ("firefox", picture)])
    listed = await get(client, "/api/visual/suites")
    assert listed == {"suites": [SUITE], "truncated": True}  # old.test's rows went unread
    matrix = await get(client, f"/api/visual/matrix?suite={SUITE}&runs=1")  # "new" is enough
    assert matrix["truncated"] is False and matrix["profiles"] == ["chromium", "firefox"]
    assert (await get(client, "/api/visual/matrix?suite=old.test"))["truncated"] is True
    monkeypatch.setattr(visual, "ROWS_PER_REQUEST", 50_000)
    assert (await get(client, "/api/visual/suites"))["suites"] == ["old.test", SUITE]


async def test_the_views_read_the_fields_they_show_not_whole_rows(client, db_path):
    """A row and a spec may each be near a megabyte, and the views show a dozen short fields of
    them: 1,000 rows of 900 KB took a suite list 5.7 s and 936 MB, each row read whole and
    parsed three times on the loop. SQLite now picks the fields out; the answers are the same."""
    import tracemalloc

    capture = await nightly_shots(client, "fat")
    bulky = await client.post("/jobs", json=job("fat-spec", "web-shots", "host",
                                                targets={"url": URL}, suite={"flows": "nightly"},
                                                params={"pad": "y" * 900_000}))
    assert bulky.status == 201, await bulky.text()
    for profile, pct in (("chromium", 4.2), ("webkit", None)):
        assert (await client.post("/results", json=shot_row("fat", capture, profile,
                                                            pct))).status == 200
    odd = shot_row("fat", capture, "edge", None)
    odd["shot"]["sha256"] = 12345  # a number where the hash goes: no capture, and a note
    assert (await client.post("/results", json=odd)).status == 200
    # Rows that are no screenshot, and every row padded past the body limit, as a database
    # filled by many posts (or an older version) may hold them.
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 10 UNION ALL SELECT i + 1 FROM n "
                       "WHERE i < 29) INSERT INTO results (job_id, device_id, iter, attempt, "
                       "workload, ok, final, preempted, metrics, artifacts, created_at) "
                       "SELECT 'fat', 'web:junk', i, 1, 'web-shots', 1, 0, 0, '{}', '[]', 0 "
                       "FROM n")
    edit_rows(db_path, "UPDATE results SET metrics = json_set(metrics, '$.pad', ?1), "
                       "extra = json_set(COALESCE(extra, '{}'), '$.pad', ?1) WHERE job_id = 'fat'",
              ("z" * 3_000_000,))
    tracemalloc.start()
    try:
        listed = await get(client, "/api/visual/suites")
        matrix = await get(client, "/api/visual/matrix?suite=nightly")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert listed == {"suites": ["nightly"], "truncated": False}
    cells = by_profile(matrix)
    assert (cells["chromium"]["status"], cells["chromium"]["diff_pct"]) == ("diverged", 4.2)
    assert cells["chromium"]["sha256"] == capture and cells["chromium"]["ok"] is False
    assert (cells["webkit"]["status"], cells["webkit"]["sha256"]) == ("new", capture)
    assert cells["edge"]["status"] == "missing" and "not a SHA-256" in cells["edge"]["note"]
    # 23 rows of 6 MB and a spec of 900 KB: read whole, the peak passed 100 MB.
    assert peak < 8 << 20, peak


async def test_a_capture_pypng_fails_on_is_one_cells_error_not_the_matrixs(client):
    """A corrupt deflate stream, a PNG with no header and a palette index past the palette
    made pypng raise what the comparison did not catch: the whole suite's matrix answered 500
    on every view, the good cells too, whoever had accepted the baseline."""
    good = png_bytes(1, 1)
    [baseline] = await shots_run(client, "run-1", [("chromium", good)])
    await accept(client, baseline)
    plain = palette_png(1, 1)
    at = plain.index(b"IDAT") - 4
    broken = plain[:at] + png_chunk(b"IDAT", b"\x78\x9c\xff\xff\xff") + png_chunk(b"IEND", b"")
    await shots_run(client, "run-2", [("chromium", broken)])  # a deflate block of no type
    matrix = await get(client, f"/api/visual/matrix?suite={SUITE}")
    [cell] = matrix["cells"]
    assert cell["status"] == "error" and "cut short or damaged" in cell["note"], cell


async def test_a_matrix_waits_for_the_comparison_slot_no_longer_than_its_budget(
        client, monkeypatch):
    """Comparisons run one at a time, and a matrix waited for the slot without a bound: one
    suite's slow files held every other suite's review for minutes. A matrix waits until its
    own budget ends and shows the cell pending."""
    monkeypatch.setattr(visual, "COMPUTE_BUDGET_S", 0.5)
    [baseline] = await shots_run(client, "run-1", [("chromium", png_bytes(8, 8))])
    await accept(client, baseline)
    await shots_run(client, "run-2", [("chromium", png_bytes(8, 8, with_stripe(2)))])
    review = client.server.app[REVIEW]
    async with review._one_at_a_time:  # another suite's comparison holds the slot
        matrix = await get(client, f"/api/visual/matrix?suite={SUITE}")
    assert [c["status"] for c in matrix["cells"]] == ["pending"]
    matrix = await get(client, f"/api/visual/matrix?suite={SUITE}")  # the slot free again
    assert [c["status"] for c in matrix["cells"]] == ["diverged"]


async def test_a_capture_named_before_its_upload_is_compared_once_it_lands(client):
    """A row may name its screenshot before the upload lands; the comparison's "not stored"
    was kept as the pair's answer for good, so the cell stayed an error after the upload."""
    [baseline] = await shots_run(client, "run-1", [("chromium", png_bytes(8, 8))])
    await accept(client, baseline)
    late = png_bytes(8, 8, with_stripe(2))
    late_sha = hashlib.sha256(late).hexdigest()
    assert (await client.post("/jobs", json=job("run-2", "web-shots", "host",
                                                targets={"url": URL}))).status == 201
    assert (await (await client.get("/executor/next-job?name=mac")).json())["job_id"] == "run-2"
    row = result_row("run-2", "mac", 1, executor="mac", ok=True, browser="chromium",
                     artifacts=[late_sha])
    assert (await client.post("/results", json=row)).status == 200
    await client.post("/results", json=result_row("run-2", "mac", 0, executor="mac",
                                                  final=True, ok=True))
    [cell] = (await get(client, f"/api/visual/matrix?suite={SUITE}"))["cells"]
    assert cell["status"] == "error" and "is not stored" in cell["note"], cell
    assert await upload(client, late) == late_sha
    [cell] = (await get(client, f"/api/visual/matrix?suite={SUITE}"))["cells"]
    assert cell["status"] == "diverged", cell
