"""The GitHub REST client against the fake GitHub API server."""

from __future__ import annotations

import pytest

from fleet_min.controlplane.github.client import GitHub, GitHubError, find_token
from tests.support.fake_github import TOKEN, FakeGitHub


async def test_runners_with_labels_and_pagination(github: FakeGitHub, gh: GitHub) -> None:
    for n in range(130):
        github.add_runner("octo/app", f"r{n}", ["gpu"] if n == 0 else None)
    runners = await gh.runners("octo/app")
    assert len(runners) == 130
    assert runners[0]["labels"] == ["self-hosted", "Linux", "X64", "gpu"]
    assert runners[0]["custom_labels"] == ["gpu"]
    assert sum(1 for m, p, s in github.log if "/runners" in p) == 2


async def test_etag_makes_the_second_read_a_304(github: FakeGitHub, gh: GitHub) -> None:
    github.add_runner("octo/app", "r1")
    first = await gh.runners("octo/app")
    remaining = gh.rate["remaining"]
    second = await gh.runners("octo/app")
    assert first == second and gh.not_modified == 1
    assert github.log[-1][2] == 304 and gh.rate["remaining"] == remaining
    github.repos["octo/app"]["runners"]["r1"]["busy"] = True
    assert (await gh.runners("octo/app"))[0]["busy"] is True


@pytest.mark.parametrize("reset", ["1e400", "1e20", "nan", "soon"])
async def test_a_rate_reset_no_clock_can_show_is_left_out(github: FakeGitHub, gh: GitHub,
                                                          reset: str) -> None:
    github.add_runner("o/r", "r1")
    github.reset_header = reset
    assert [r["name"] for r in await gh.runners("o/r")] == ["r1"]
    assert gh.rate == {}  # the headers are read whole or not at all


async def test_retries_on_5xx_then_gives_up(github: FakeGitHub, gh: GitHub) -> None:
    github.add_runner("octo/app", "r1")
    github.fail_next = 2
    assert len(await gh.runners("octo/app")) == 1
    github.fail_next = 5
    with pytest.raises(GitHubError, match="502 after 3 attempts"):
        await gh.runners("octo/app")


async def test_bad_token_and_unknown_repo(github: FakeGitHub) -> None:
    github.repo("octo/app")
    client = GitHub(github.url, "wrong", backoff_s=0.01)
    try:
        with pytest.raises(GitHubError) as caught:
            await client.runners("octo/app")
        assert caught.value.status == 401
    finally:
        await client.close()
    client = GitHub(github.url, TOKEN, backoff_s=0.01)
    try:
        with pytest.raises(GitHubError, match="404"):
            await client.runs("octo/nothing", "queued")
        with pytest.raises(GitHubError, match="not an owner/repo"):
            await client.runners("../../etc")
    finally:
        await client.close()


async def test_runs_jobs_and_tokens(github: FakeGitHub, gh: GitHub) -> None:
    run_id = github.add_run("octo/app", "queued", "2026-01-01T00:00:00Z", ["self-hosted"])
    [run] = await gh.runs("octo/app", "queued")
    assert run["id"] == run_id and run["repo"] == "octo/app"
    [job] = await gh.jobs("octo/app", run_id)
    assert job["labels"] == ["self-hosted"] and job["status"] == "queued"
    token = await gh.registration_token("octo/app")
    assert github.issued[token] == ("registration", "octo/app")
    assert github.issued[await gh.removal_token("octo/app")][0] == "remove"
    assert gh.status()["rate_limit"]["limit"] == 5000


async def test_never_sends_the_token_off_origin(gh: GitHub) -> None:
    with pytest.raises(GitHubError, match="refusing"):
        await gh.request("GET", "https://elsewhere.example/x")


def test_token_from_environment_or_gh(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert find_token({"GH_TOKEN": " a "}) == "a"
    assert find_token({"GITHUB_TOKEN": "b"}) == "b"
    gh = tmp_path / "gh"
    gh.write_text("#!/bin/sh\n[ \"$1 $2\" = \"auth token\" ] && echo gho_fromgh\n")
    gh.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_token({}) == "gho_fromgh"
    gh.write_text("#!/bin/sh\nexit 1\n")
    assert find_token({}) is None
