"""Each benchmark of bench/ runs end to end at tiny sizes (--quick) and prints valid JSON lines
followed by its table. The figures themselves are never asserted: benchmarks are not timed tests.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from bench.common import Http, server
from bench.lifecycle import final_row, pinned_job
from bench.profile_split import py_spy
from tests.support.collector import ROOT

pytestmark = pytest.mark.slow


def run_bench(name: str, *extra: str) -> list[dict[str, object]]:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick", *extra],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records, result.stdout
    assert all(r["bench"] == name for r in records)
    assert not lines[-1].startswith("{"), "the table follows the JSON lines"
    return records


def figure(records: list[dict[str, object]], name: str) -> dict[str, object]:
    found = [r for r in records if r.get("figure") == name]
    assert found, f"no {name!r} figure in {records}"
    return found[-1]


@pytest.mark.parametrize("ceilings", [(), ("durable", "floor")],
                         ids=["two-servers", "with-durable-and-floor"])
def test_lifecycle_smoke(ceilings):
    records = run_bench("lifecycle", *(f"--{kind}" for kind in ceilings))
    assert {r["server"] for r in records if "server" in r} == {"bare", "collector", *ceilings}
    result = figure(records, "lifecycle")
    keys = ["jobs_per_s", "bare_jobs_per_s", "cpu_ms_per_job", "bare_cpu_ms_per_job", "cpu_ratio"]
    # Each job of a ceiling was enqueued, claimed (a 200, not a 204) and closed: the bench's
    # agents check every answer's status.
    for kind in ceilings:
        keys += [f"{kind}_jobs_per_s", f"{kind}_cpu_ms_per_job", f"{kind}_cpu_ratio"]
    for key in keys:
        assert isinstance(result[key], float), key
    assert ("durable_cpu_ratio" in result) is bool(ceilings)
    assert result["rounds"] == 1


def test_the_spec_floor_keeps_the_rules_it_prices(tmp_path):
    """The floor server must refuse what the spec refuses, or its figure is not the floor of a
    server keeping the spec's rules: a bad spec, a taken id, a device without the capability,
    a row from a device that does not hold the job."""
    async def drive(address):
        http = Http(address)
        for device, caps in (("pi", ["benchmark"]), ("cam", ["camera"]), ("other", ["benchmark"])):
            await http.request("POST", "/devices/register", {
                "device_id": device, "descriptor": {}, "capabilities": caps})
        spec = pinned_job("pi", "j1")
        assert (await http.request("POST", "/jobs", {**spec, "workload": 5}))[0] == 400
        assert (await http.request("POST", "/jobs", spec))[0] == 201
        assert (await http.request("POST", "/jobs", spec))[0] == 409
        assert (await http.request("POST", "/jobs", {
            **spec, "job_id": "j2", "targets": {"device_id": "cam"}}))[0] == 201
        assert (await http.request("GET", "/devices/cam/next-job"))[0] == 204
        status, body = await http.request("GET", "/devices/pi/next-job")
        assert status == 200 and json.loads(body)["job_id"] == "j1"
        row = final_row("other", "j1")
        assert (await http.request("POST", "/results", row))[0] == 409
        assert (await http.request("POST", "/results", {**row, "iter": "zero"}))[0] == 400
        assert (await http.request("POST", "/results", {**row, "device_id": "pi"}))[0] == 200
        http.close()

    with server("floor") as (address, _pid):
        asyncio.run(drive(address))


def test_lifecycle_split_smoke():
    records = run_bench("lifecycle_split")
    result = figure(records, "lifecycle_split")
    for kind in ("bare", "durable", "floor", "collector"):
        assert {r["phase"] for r in records if r.get("server") == kind} == {
            "enqueue", "claim+result"}
        assert isinstance(result[kind]["cpu_us_per_job"], float)


def test_profile_split_smoke():
    # py-spy reads the servers' memory: a machine whose kernel forbids that (ptrace refused,
    # as in some containers) cannot run this bench at all, which says nothing of the bench.
    spy = py_spy()
    assert spy, "py-spy is not installed: the test extra installs it"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        dumped = subprocess.run([spy, "dump", "--pid", str(sleeper.pid)], capture_output=True,
                                text=True, timeout=60)
    finally:
        sleeper.kill()
        sleeper.wait()
    if dumped.returncode != 0 and "ermission" in dumped.stdout + dumped.stderr:
        pytest.skip(f"this machine lets no process read another's memory: {dumped.stderr[:200]}")
    records = run_bench("profile_split")
    assert [r["server"] for r in records if "round" in r] == ["collector", "floor"]
    records = [r for r in records if r.get("figure") == "profile_split"]  # the medians
    assert [r["server"] for r in records] == ["collector", "floor"]
    for record in records:
        parts = record["parts_us_per_job"]
        # each thread's samples are weighed by its own CPU: the parts add up to the server's
        # CPU a job, less any thread py-spy never caught running
        assert 0.5 * record["cpu_us_per_job"] <= sum(parts.values()) <= 1.2 * record[
            "cpu_us_per_job"], record
        assert parts["http"] > 0 and parts["bodies"] > 0, record
    collector = records[0]
    assert any(body.startswith(("post_result ", "_poll_look ", "enqueue "))
               for body in collector["bodies_us_per_job"]), collector


def test_profile_split_sorts_samples_into_parts():
    from bench.profile_split import part_of

    loop = ["<module> (fleet_min/__main__.py:3)", "run (fleet_min/serving.py:90)",
            "Runner.run (asyncio/runners.py:118)"]
    body = [*loop, "_Writer._run (fleet_min/db.py:300)", "_run_bodies (fleet_min/db.py:80)",
            "Service.transact.<locals>.run (fleet_min/collector/service.py:244)",
            "post_result (fleet_min/collector/jobs/results.py:50)", "execute (x.py:1)"]
    assert part_of(body, "MainThread", 70) == (
        "bodies", "post_result (fleet_min/collector/jobs/results.py)")
    assert part_of(["_commit_loop (fleet_min/db.py:400)"], "db-commit", 70) == ("commit", None)
    assert part_of([*loop, "_Writer._run (fleet_min/db.py:310)"], "MainThread", 70) == (
        "writer", None)
    assert part_of(loop, "MainThread", 70) == ("http", None)  # the native loop
    assert part_of([*loop, "RequestHandler.start (aiohttp/web_protocol.py:9)"], "MainThread",
                   70) == ("http", None)
    assert part_of([*loop, "_Counted.data_received (fleet_min/serving.py:180)"], "MainThread",
                   70) == ("http", None)  # aiohttp's C parser, under the wrapper
    assert part_of([*loop, "read_json (fleet_min/http.py:60)"], "MainThread", 70) == (
        "app", None)
    writer = ["Thread.run (threading.py:982)", "Writer._run (bench/durable_server.py:70)"]
    assert part_of(writer, "Thread-1 (_run)", 70) == ("commit", None)
    assert part_of(writer, "Thread-1 (_run)", 69) == ("bodies", None)
    assert part_of([*writer, "_claim (bench/floor_server.py:93)"], "Thread-1 (_run)", 70) == (
        "bodies", None)


@pytest.mark.parametrize("statements", [False, True], ids=["bodies", "with-statements"])
def test_bodies_smoke(statements):
    # Each body's own assertions hold in the run: every job is claimed in order and closed done
    # by the collector's functions and by the floor's.
    records = run_bench("bodies", *(["--statements"] if statements else []))
    result = figure(records, "bodies")
    for kind in ("collector", "floor"):
        for part in ("check_us", "enqueue_us", "claim_us", "result_us", "commit_us", "bodies_us"):
            assert isinstance(result[kind][part], float), (kind, part)
    assert isinstance(result["bodies_ratio"], float)
    listed = result.get("statements", [])
    assert bool(listed) is statements
    assert all(entry["per_job"] >= 1 for entry in listed)


def test_compare_smoke():
    # No trees given: this tree against itself, both collectors under load at once.
    result = figure(run_bench("compare"), "cpu_per_job_new_over_old")
    assert result["rounds"] == 1 and result["old"] == result["new"]
    assert isinstance(result["median"], float) and result["median"] > 0


def test_compare_refuses_a_directory_that_is_not_a_tree(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "is not a checkout of fleet_min" in result.stderr


def test_dispatch_smoke():
    result = figure(run_bench("dispatch"), "dispatch_latency")
    for key in ("p50_ms", "p99_ms", "bare_p50_ms", "p50_ratio", "two_commits_ms"):
        assert isinstance(result[key], float), key


def test_claim_cost_smoke():
    records = run_bench("claim_cost")
    assert {r["variant"] for r in records if r.get("figure") == "load"} == {"pinned",
                                                                             "undeclared"}
    for name in ("poll_cost", "claim_cost"):
        costs = [r for r in records if r.get("figure") == name]
        assert {r["variant"] for r in costs} == {"pinned", "undeclared"}
        assert all(isinstance(r["ratio"], float) for r in costs)


def test_idle_polls_smoke():
    result = figure(run_bench("idle_polls"), "idle_polls")
    assert result["polls"] == 40
    for key in ("held", "on_time", "kib_per_poll", "bare_kib_per_poll", "ratio"):
        assert isinstance(result[key], int | float), key


@pytest.mark.parametrize("rows_per_request", ["1", "5"])
def test_ingest_smoke(rows_per_request):
    result = figure(run_bench("ingest", "--rows-per-request", rows_per_request), "ingest")
    for key in ("rows_per_s", "sqlite_grouped_rows_per_s", "bare_rows_per_s",
                "ratio_to_sqlite", "mean_rows_per_commit", "loop_busy", "commit_ms",
                "sqlite_grouped_ms_per_commit"):
        assert isinstance(result[key], float), key
    assert result["rows_per_request"] == int(rows_per_request)
    assert "against_rows_per_s" not in result


def test_ingest_against_another_tree_smoke():
    # This checkout as the "other" tree: the round carries both collectors' figures.
    records = run_bench("ingest", "--against", str(ROOT))
    (one_round,) = [r for r in records if r.get("figure") == "round"]
    assert one_round["against"]["rows"] > 0
    result = figure(records, "ingest")
    for key in ("against_rows_per_s", "against_main_us_per_row", "over_against_rows_per_s",
                "over_against_main_us_per_row"):
        assert isinstance(result[key], float), key


def test_commit_handoff_smoke():
    records = run_bench("commit_handoff")
    ways = [r["way"] for r in records if r.get("figure") == "way"]
    assert ways == ["alone", "idle", "busy", "busy, no release"]
    result = figure(records, "handoff")
    assert set(result["ways"]) == set(ways)
    assert all(isinstance(w["median_ms"], float) for w in result["ways"].values())
    assert isinstance(result["busy_over_alone"], float)


def test_startup_smoke():
    records = run_bench("startup")
    starts = [r for r in records if r.get("figure") == "start"]
    assert {r["kind"] for r in starts} == {"pyz", "pyz -S", "module"}
    assert all(isinstance(r["start_ratio"], float) for r in starts)
    assert isinstance(figure(records, "ceiling")["python_pass_s"], float)


def test_controlplane_smoke():
    records = run_bench("controlplane")
    rebuild = figure(records, "rebuild")
    assert rebuild["runners"] == 5 and isinstance(rebuild["rebuild_p50_ms"], float)
    assert isinstance(figure(records, "rebuild_api")["forced_rebuild_p50_ms"], float)
    simulate = figure(records, "simulate")
    assert "skipped" in simulate or isinstance(simulate["simulate_p50_s"], float)


def test_retention_smoke():
    result = figure(run_bench("retention"), "retention")
    assert result["beacons_kept"] == 20 * 1440 * 2  # the --quick window: two days
    for key in ("largest_mib", "final_mib", "slowest_transaction_ms", "longest_loop_stall_ms"):
        assert isinstance(result[key], (int, float)), key


def test_agents_smoke():
    records = run_bench("agents")
    rounds = [r for r in records if r.get("figure") == "round"]
    assert {(r["server"], r["agents"]) for r in rounds} == {
        (server, agents) for server in ("bare", "collector") for agents in (20, 60)}
    assert all(r["errors"] == 0 for r in rounds), rounds
    result = figure(records, "agents")
    assert result["agents"] == [20, 60]
    for key in ("cpu_shares", "us_per_beacon", "rss_mib", "kib_per_agent"):
        assert all(isinstance(value, float) for value in result[key]), key


def test_request_costs_smoke():
    records = run_bench("request_costs")
    kinds = [r for r in records if r.get("figure") == "kind"]
    assert {(r["server"], r["kind"]) for r in kinds} == {
        (server, kind) for server in ("collector", "bare") for kind in ("health", "beacon",
                                                                        "renewal")}
    assert all(r["requests"] > 0 and r["unexpected"] == 0 for r in kinds), kinds
    ratios = [r for r in records if r.get("figure") == "ratio"]
    assert {r["kind"] for r in ratios} == {"health", "beacon", "renewal"}


def test_device_listing_smoke():
    records = run_bench("device_listing")
    result = figure(records, "device_listing")
    assert result["devices"] == 50 and result["bytes"] > 0
    for key in ("listing_s", "worst_reader_s", "worst_loop_s", "idle_worst_reader_s",
                "peak_rss_mb"):
        assert isinstance(result[key], float), key


ANSWERS = {
    "executors": None,
    "enroll": None,
    "preview": None,
    "metrics": None,
    "overview": None,
    "register": None,  # under the bound at --quick's 50 devices: registered
    "fanout": "fan-out matched no registered device that can run 'benchmark'; check targets "
              "and capabilities with POST /api/jobs/preview-targets",
    "undeclared": "no registered agent declares the capability 'nobody-declares' and it is not "
                  "built in; register an agent that declares it first",
}


@pytest.mark.parametrize("ask", sorted(ANSWERS))
def test_device_listing_asks_each_request_over_the_registry(ask):
    rounds = [r for r in run_bench("device_listing", "--ask", ask) if "round" in r]
    assert rounds and all(r["ask"] == ask and r["devices"] == 0 for r in rounds), rounds
    assert {r["answer"] for r in rounds} == {ANSWERS[ask]}, rounds


def test_restore_rows_smoke():
    result = figure(run_bench("restore_rows"), "row_check")
    assert result["rows"] == 2000 + 2000 + 200
    for key in ("rebuild_s", "check_s", "check_us_per_row"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, key
    # The copy's time is the rebuild's less the check's: on a busy machine, at this size, it
    # can be nothing, and then there is no ratio (a figure, never asserted here).
    assert isinstance(result["copy_s"], (int, float))
    assert result["ratio"] is None or result["ratio"] > 0
