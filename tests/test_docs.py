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
