"""The agent configured through its environment variables alone, as a service unit may run it:
a real agent process registers with a real collector; a bad value is refused with a sentence
naming the variable, and a flag wins over its variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.agent import AGENT_FILE, REPO, wait_for

pytestmark = pytest.mark.slow


def test_an_agent_configured_by_environment_alone_registers(procs, tmp_path):
    collector = procs.collector()
    env = {"FLEET_AGENT_COLLECTOR": collector.url, "FLEET_AGENT_DEVICE_ID": "env-1",
           "FLEET_AGENT_STATE": str(tmp_path / "env-state"), "FLEET_AGENT_POOL": "lab,bench",
           "FLEET_AGENT_BEACON_S": "1", "FLEET_AGENT_SET": "kind=tablet,model=Env Tab",
           "FLEET_AGENT_LOG_LEVEL": "debug"}
    log_path = tmp_path / "env-agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen([sys.executable, str(AGENT_FILE)], cwd=REPO,
                                 env={**os.environ, **env}, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        device = wait_for(lambda: (lambda r: r[1] if r[0] == 200 else None)(
            collector.get("/api/devices/env-1")), 20, what="registration")
        assert sorted(device["pools"]) == ["bench", "lab"]
        assert device["descriptor"]["kind"] == "tablet"
        assert device["descriptor"]["model"] == "Env Tab"
        assert (tmp_path / "env-state" / "state.json").exists()
    finally:
        agent.terminate()
        assert agent.wait(20) == 0


@pytest.mark.parametrize("env, says", [
    ({"FLEET_AGENT_BEACON_S": "often"}, "FLEET_AGENT_BEACON_S='often' is not a valid value"),
    ({"FLEET_AGENT_EXECUTOR": "phone"}, "FLEET_AGENT_EXECUTOR must be one of device, host"),
    ({"FLEET_AGENT_COLLECTOR": "collector:8788"}, "must start with http:// or https://"),
    # Each of these failed every request and was retried as an unreachable collector for ever.
    ({"FLEET_AGENT_COLLECTOR": "http://]x:8788"}, "'http://]x:8788' is not a URL such as"),
    ({"FLEET_AGENT_COLLECTOR": "http://x:99999"}, "'http://x:99999' is not a URL such as"),
    ({"FLEET_AGENT_COLLECTOR": "http://a\uff03b:1"}, "is not a URL such as"),
    ({"FLEET_AGENT_COLLECTOR": "http://"}, "'http://' names no host"),
])
def test_a_bad_variable_is_refused_with_a_sentence(tmp_path, env, says):
    result = subprocess.run([sys.executable, str(AGENT_FILE), "--state-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "FLEET_AGENT_COLLECTOR": "http://127.0.0.1:9",
                                 **env})
    assert result.returncode == 2
    assert says in result.stderr and "Traceback" not in result.stderr


def test_a_flag_wins_over_its_variable(fa, tmp_path):
    cfg = fa.parse_args(["--collector", "http://flag:1", "--beacon-s", "7"],
                        {"FLEET_AGENT_COLLECTOR": "http://env:1", "FLEET_AGENT_BEACON_S": "9",
                         "FLEET_AGENT_GRACE_S": "4", "FLEET_AGENT_STATE": str(tmp_path),
                         "FLEET_AGENT_LOG_LEVEL": "debug"})
    assert cfg.collectors == ["http://flag:1"] and cfg.beacon_s == 7.0
    assert cfg.grace_s == 4.0 and cfg.state_dir == str(tmp_path) and cfg.log_level == "DEBUG"
    defaults = fa.parse_args(["--collector", "http://a:1"], {})
    assert defaults.beacon_s == 60.0 and defaults.executor == "device"
    assert defaults.state_dir == os.path.expanduser("~/.fleet-agent")


@pytest.mark.parametrize("how, password", [("flag", "s3cret"), ("variable", "s3cret"),
                                           ("flag", "s3c/ret"), ("flag", "s3c?r#et")])
def test_a_collector_address_with_a_user_and_password_is_refused_without_showing_them(
        tmp_path, how, password):
    """The agent sends no credentials from a URL; one given would be logged and told to the
    other collectors in busy beacons, so the agent refuses to start, and never repeats it. A
    password holding "/", "?" or "#" ends the URL's host part before its "@" to a parser, and
    was let through (and logged on every retry)."""
    urls = f"http://127.0.0.1:9,http://alice:{password}@127.0.0.1:8/base"
    argv = ["--collector", urls] if how == "flag" else []
    env = {**os.environ, "FLEET_AGENT_COLLECTOR": urls} if how == "variable" else {
        k: v for k, v in os.environ.items() if k != "FLEET_AGENT_COLLECTOR"}
    result = subprocess.run([sys.executable, str(AGENT_FILE), "--state-dir",
                             str(tmp_path / "state"), *argv], capture_output=True, text=True,
                            timeout=30, env=env)
    assert result.returncode == 2, result
    assert result.stderr.splitlines()[-1] == (
        "fleet_agent.py: error: collector address http://...@127.0.0.1:8/base carries a user "
        "name or password; the agent does not send credentials from a URL, so give the address "
        "without them")
    assert "s3c" not in result.stderr + result.stdout and "alice" not in result.stderr
    assert not (tmp_path / "state").exists()
