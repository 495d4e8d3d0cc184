"""Every queue cause, one test each, through the pure classifier (the daemon tests see them
again end to end)."""

from __future__ import annotations

from typing import Any

from fleet_min.controlplane.analysis.queue_causes import ORDER, Context, classify_run, queue_causes

NOW = 1767225600.0  # 2026-01-01T00:00:00Z
REPO = "octo/app"
ROOM = {"can_add": True, "reasons": [], "per_repo": {REPO: 1},
        "limits": {"max_per_repo": 4}}
FULL = {"can_add": False, "reasons": ["2 runners already reach the ceiling of 2"],
        "per_repo": {REPO: 2}, "limits": {"max_per_repo": 4}}


def run(status: str = "queued", run_id: int = 1, waited_s: int = 300) -> dict[str, Any]:
    created = "2025-12-31T23:55:00Z" if waited_s == 300 else "2025-12-31T23:59:50Z"
    return {"id": run_id, "repo": REPO, "name": "CI", "status": status, "created_at": created}


def job(labels: list[str], run_id: int = 1) -> dict[str, Any]:
    return {"id": 100 + run_id, "run_id": run_id, "name": "build", "status": "queued",
            "labels": labels}


def runner(name: str, labels: list[str], status: str = "online", busy: bool = False
           ) -> dict[str, Any]:
    return {"name": name, "status": status, "busy": busy, "labels": ["self-hosted", *labels]}


def view(name: str, state: str = "idle", draining: bool = False) -> dict[str, Any]:
    return {"name": name, "state": state, "draining": draining}


def context(registered: list[dict[str, Any]] | None,
            views: tuple[dict[str, Any], ...] | list[dict[str, Any]] = (),
            capacity: dict[str, Any] = ROOM, error: str | None = None) -> Context:
    return Context(registered={REPO: registered}, views={v["name"]: v for v in views},
                   local={v["name"] for v in views}, capacity=capacity,
                   errors={REPO: error} if error else {})


def cause(ctx: Context, labels: list[str] | None = None, status: str = "queued",
          waited_s: int = 300) -> dict[str, Any]:
    jobs = [job(labels)] if labels is not None else []
    return classify_run(run(status, waited_s=waited_s), jobs, ctx, NOW)


def test_the_order_names_every_cause_once() -> None:
    assert len(set(ORDER)) == len(ORDER) == 9


def test_telemetry_unavailable_when_github_runner_list_is_missing() -> None:
    c = cause(context(None, error="GitHub answered 403"), ["self-hosted"])
    assert (c["cause"], c["confidence"]) == ("telemetry-unavailable", "low")
    assert c["evidence"] == ["GitHub answered 403"]
    assert c["recommendation"]["action"] is None


def test_telemetry_unavailable_when_the_runs_jobs_are_not_listed_yet() -> None:
    c = cause(context([runner("r1", [])]))
    assert c["cause"] == "telemetry-unavailable" and "labels are unknown" in c["message"]


def test_unserved_when_no_runner_is_registered() -> None:
    c = cause(context([]), ["self-hosted", "linux"])
    assert (c["cause"], c["confidence"]) == ("unserved", "high")
    assert "config.sh" in c["recommendation"]["text"]


def test_label_mismatch_names_the_closest_runner_and_the_missing_labels() -> None:
    ctx = context([runner("r1", ["linux"]), runner("r2", ["linux", "gpu"])])
    c = cause(ctx, ["self-hosted", "linux", "gpu", "big"])
    assert c["cause"] == "label-mismatch"
    assert c["evidence"][0] == "closest: r2 lacks big"
    assert c["jobs"][0]["labels"] == ["self-hosted", "linux", "gpu", "big"]


def test_runner_down_offline_draining_or_service_dead() -> None:
    ctx = context([runner("off", ["x"], status="offline"), runner("drn", ["x"]),
                   runner("dead", ["x"])],
                  [view("drn", draining=True), view("dead", state="failed")])
    c = cause(ctx, ["self-hosted", "x"])
    assert c["cause"] == "runner-down"
    assert set(c["evidence"]) == {"off is offline on GitHub", "drn is draining",
                                  "the service of dead is failed"}


def test_concurrency_block_for_a_pending_run() -> None:
    c = cause(context([runner("r1", [])]), ["self-hosted"], status="pending")
    assert (c["cause"], c["confidence"]) == ("concurrency-block", "high")
    assert "/api/concurrency" in c["recommendation"]["text"]


def test_host_saturated_when_busy_and_no_room_here() -> None:
    ctx = context([runner("r1", [], busy=True)], [view("r1", state="working")], capacity=FULL)
    c = cause(ctx, ["self-hosted"])
    assert c["cause"] == "host-saturated"
    assert "2 runners already reach the ceiling of 2" in c["evidence"]
    assert c["recommendation"]["action"] is None


def test_repo_at_capacity_recommends_duplicating_a_local_runner() -> None:
    ctx = context([runner("r1", [], busy=True)], [view("r1", state="working")])
    c = cause(ctx, ["self-hosted"])
    assert (c["cause"], c["confidence"]) == ("repo-at-capacity", "high")
    assert c["recommendation"]["action"] == {"id": "runner.duplicate", "args": {"name": "r1"}}


def test_repo_at_capacity_at_the_per_repo_limit_says_raise_it() -> None:
    limited = {**ROOM, "per_repo": {REPO: 4}}
    ctx = context([runner("r1", [], busy=True)], [view("r1", state="working")],
                  capacity=limited)
    c = cause(ctx, ["self-hosted"])
    assert c["cause"] == "repo-at-capacity" and c["recommendation"]["action"] is None
    assert "max_per_repo" in c["recommendation"]["text"]


def test_repo_at_capacity_on_other_hosts_only() -> None:
    c = cause(context([runner("elsewhere", [], busy=True)]), ["self-hosted"])
    assert (c["cause"], c["confidence"]) == ("repo-at-capacity", "medium")


def test_github_delay_confidence_grows_with_the_wait() -> None:
    ctx = context([runner("r1", [])], [view("r1")])
    long = cause(ctx, ["self-hosted"])
    short = cause(ctx, ["self-hosted"], waited_s=10)
    assert (long["cause"], long["confidence"]) == ("github-delay", "high")
    assert (short["cause"], short["confidence"]) == ("github-delay", "low")


def test_github_hosted_job() -> None:
    c = cause(context([runner("r1", [])]), ["ubuntu-latest"])
    assert (c["cause"], c["confidence"]) == ("github-hosted", "high")


def test_a_run_is_named_by_its_most_blocking_job() -> None:
    ctx = context([runner("r1", ["linux"])], [view("r1")])
    jobs = [job(["ubuntu-latest"]), job(["self-hosted", "gpu"]), job(["self-hosted", "linux"])]
    c = classify_run(run(), jobs, ctx, NOW)
    assert c["cause"] == "label-mismatch"
    assert [j["cause"] for j in c["jobs"]] == ["github-hosted", "label-mismatch", "github-delay"]


def test_only_queued_and_pending_runs_are_classified() -> None:
    runs = [run("queued", 1), run("in_progress", 2), run("pending", 3)]
    out = queue_causes(runs, [job(["self-hosted"], 1)], context([runner("r1", [])]), NOW)
    assert [c["run_id"] for c in out] == [1, 3]
    assert out[0]["queued_s"] == 300


def test_many_runs_of_matrix_jobs_are_each_given_their_own_jobs_verdicts() -> None:
    """Each run's jobs are found once and judged once per label set (each run looked through
    every job, and every job was judged alone: 150 runs of 256 took 13 s a snapshot); every
    run and job still gets its own verdict, and a job whose run id is not one is left out."""
    ctx = context([runner("r1", ["linux"]), runner("r2", ["linux", "gpu"], busy=True)],
                  [view("r1"), view("r2")])
    runs = [run("queued", n, waited_s=10 if n % 2 else 300) for n in range(1, 41)]
    jobs = [dict(job(["self-hosted", "linux"] + (["gpu"] if k % 2 else []), n), id=n * 1000 + k)
            for n in range(1, 41) for k in range(64)]
    jobs.append(dict(job(["self-hosted"]), run_id=[1]))
    out = queue_causes(runs, jobs, ctx, NOW)
    assert len(out) == 40 and all(len(c["jobs"]) == 64 for c in out)
    for c in out:
        alone = [classify_run(run("queued", c["run_id"], waited_s=10 if c["run_id"] % 2
                                  else 300), [j], ctx, NOW)["jobs"][0]["cause"]
                 for j in jobs if j["run_id"] == c["run_id"]]
        assert [j["cause"] for j in c["jobs"]] == alone
        assert c["cause"] == "repo-at-capacity" and c["confidence"] == "high"
    assert {c["queued_s"] for c in out} == {10, 300}
