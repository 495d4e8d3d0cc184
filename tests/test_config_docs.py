"""Every setting of every program is documented, in docs/configuration.md and in its `--help`,
and the documented tables are exactly what scripts/gen_config_docs.py writes from the code."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from types import ModuleType

import pytest

from fleet_min.config import COLLECTOR_SETTINGS
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS, LIVE_SETTINGS
from tests.support.agent import AGENT_FILE, load_agent
from tests.support.collector import ROOT

GENERATOR = ROOT / "scripts" / "gen_config_docs.py"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agent_options() -> list[tuple[str, str | None]]:
    """(flag, environment variable) of every option the agent's parser takes, but --help."""
    parser = load_agent().build_parser()
    return [(a.option_strings[0], getattr(a, "env", None)) for a in parser._actions
            if a.option_strings and a.option_strings[0] != "-h"]


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("doc", ["configuration.md", "controlplane.md", "agent.md"])
def test_each_generated_table_is_what_the_generator_writes(doc: str) -> None:
    text = (ROOT / "docs" / doc).read_text()
    assert generator().render(text) == text, (
        f"docs/{doc} differs from the code: run python3 scripts/gen_config_docs.py")


def test_the_generator_puts_back_a_table_that_drifted() -> None:
    text = CONFIGURATION.read_text()
    drifted = text.replace("| `FLEET_PORT` | `--port` | `8788` |", "| `FLEET_PORT` | `--port` | "
                           "`9999` |").replace("| `FLEET_AGENT_GRACE_S` |", "| `FLEET_GRACE` |")
    assert drifted != text
    assert generator().render(drifted) == text


def test_the_generator_check_mode_passes_on_this_tree() -> None:
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                            text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr


def test_configuration_names_every_setting_of_every_program() -> None:
    text = CONFIGURATION.read_text()
    for setting in (*COLLECTOR_SETTINGS, *CONTROLPLANE_SETTINGS):
        assert f"| `{setting.env}` |" in text, setting.env
    for live in LIVE_SETTINGS:
        assert f"| `{live.key}` | `{live.env}` |" in text, live.key
    for flag, env in agent_options():
        assert re.search(rf"\| `{re.escape(flag)}[ `]", text), flag
        if env:
            assert f"`{env}`" in text, env


def test_agent_doc_shows_log_level_and_version() -> None:
    text = (ROOT / "docs" / "agent.md").read_text()
    assert "| `--log-level DEBUG\\|INFO\\|WARNING\\|ERROR` | `FLEET_AGENT_LOG_LEVEL` |" in text
    assert "| `--version` |" in text


def _help(*argv: str) -> str:
    result = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return flat(result.stdout)


@pytest.mark.parametrize("service, settings", [("collector", COLLECTOR_SETTINGS),
                                               ("controlplane", CONTROLPLANE_SETTINGS)])
def test_each_service_help_shows_every_default_and_variable(service, settings) -> None:
    text = _help("-m", "fleet_min", service)
    for setting in settings:
        if setting.flag:  # "--port PORT  TCP port. (default: 8788; env FLEET_PORT)"
            assert re.search(rf"{re.escape(setting.flag)} \S+ .*?\(default: [^;]+; env "
                             rf"{setting.env}\)", text), setting.flag
        else:
            assert f"{setting.env} (default: " in text, setting.env
    if service == "controlplane":
        for live in LIVE_SETTINGS:
            assert f"{live.env} (default: " in text, live.env


def test_agent_help_shows_every_default_and_variable() -> None:
    text = _help(str(AGENT_FILE))
    for flag, env in agent_options():
        if env:
            assert re.search(rf"{re.escape(flag)} \S+ .*?\(default: [^;]+; env {env}\)", text), \
                flag
        else:
            assert flag in text
