"""The docs that are generated from code stay in step with it."""

from __future__ import annotations

import re

from fleet_min.config import COLLECTOR_SETTINGS, markdown_table
from tests.support.collector import ROOT


def test_configuration_doc_lists_every_collector_setting():
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- collector-settings:begin -->\n(.*?)\n<!-- collector-settings:end -->",
                      text, re.S)
    assert block, "docs/configuration.md lost its generated collector table"
    assert block.group(1).strip() == markdown_table(COLLECTOR_SETTINGS).strip(), (
        "regenerate the table in docs/configuration.md from fleet_min.config")


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    assert blocks[0] == "python3 -m pip install . && python3 -m fleet_min collector"
    assert blocks[1] == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in ci


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exact versions only: {line!r}"
            pins[name] = version
    return pins


def test_the_test_command_installs_the_pinned_tools():
    """A fresh machine gets the versions the suite passes with, not the newest releases: every
    requirement of the package, its test extra and its fast extra is pinned exactly, and the
    README's test command installs through the pins."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [r for extra in ("test", "fast")
                                        for r in project["optional-dependencies"][extra]]
    pins = _pins()
    for text in wanted:
        requirement = Requirement(text)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(Version(pins[name])), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {requirement}")
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--constraint constraints.txt" in script
