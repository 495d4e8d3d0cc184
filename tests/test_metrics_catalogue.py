"""The metrics' catalogue stays in step with the code: every metric the sample Grafana dashboard
(deploy/grafana/fleet-min.json) queries is one the services export, every metric they export is
in docs/metrics.md, and every metric that page names is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fleet_min import metrics
from tests.support.metrics import registries

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "fleet-min.json"
DOC = ROOT / "docs" / "metrics.md"
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                          "offset", "bool", "and", "or", "unless", "inf", "nan", "Inf", "NaN"})
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def query_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    aggregations, keywords, label names (in matchers and in by/without/on lists) or parts of
    numbers, strings and durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ",
                  text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    names = set()
    for found in _NAME.finditer(text):
        before = text[found.start() - 1] if found.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent of a number (1e3)
        if text[found.end():].lstrip().startswith("(") or found.group() in PROMQL_WORDS:
            continue
        names.add(found.group())
    return names


def dashboard_panels(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found += dashboard_panels(panel)
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, metrics.Registry]:
    return registries(tmp_path_factory.mktemp("registries"))


def test_the_query_reader_finds_metric_names_only():
    assert query_metric_names('histogram_quantile(0.99, sum by (le, status) '
                              '(rate(x_bucket{le!="+Inf",a=~"b|c"}[5m] offset 1h)))') == \
        {"x_bucket"}
    assert query_metric_names("sum without (job) (a_total) / on (instance) group_left b "
                              "> 1e3 and c") == {"a_total", "b", "c"}
    assert query_metric_names("max(process_open_fds) or vector(0)") == {"process_open_fds"}


def test_every_dashboard_query_selects_exported_metrics(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    names = set().union(*(registry.sample_names for registry in exported.values()))
    panels = [p for p in dashboard_panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in dashboard_panels(dashboard)}) == len(dashboard_panels(dashboard))
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            selected = query_metric_names(target["expr"])
            assert selected, f"{panel['title']!r}: {target['expr']!r} selects no metric"
            unknown = selected - names
            assert not unknown, f"{panel['title']!r} queries {sorted(unknown)}, which no " \
                                "service exports"
            used |= selected
    for wanted in ("fleet_collector_jobs", "fleet_collector_claim_wait_seconds_bucket",
                   "fleet_collector_devices", "fleet_collector_beacon_age_seconds_bucket",
                   "fleet_collector_results_ingested_total", "fleet_collector_artifact_bytes",
                   "fleet_collector_db_bytes", "fleet_collector_db_wal_bytes",
                   "fleet_controlplane_runners", "fleet_controlplane_queue_wait_seconds",
                   "fleet_controlplane_github_rate_limit_remaining",
                   "fleet_controlplane_member_heartbeat_age_seconds"):
        assert wanted in used, f"the dashboard has no panel on {wanted}"


def test_histogram_quantiles_group_by_le(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if "histogram_quantile" in target["expr"]:
                assert re.search(r"by \([^)]*\ble\b", target["expr"]), target["expr"]
                assert all(name.endswith("_bucket")
                           for name in query_metric_names(target["expr"])), target["expr"]


def test_the_metrics_page_lists_every_metric_and_only_those(exported):
    text = DOC.read_text()
    for service, registry in exported.items():
        for family in registry.families:
            row = re.search(rf"^\| `{re.escape(family.name)}` \| {family.kind} \|", text,
                            re.MULTILINE)
            assert row, f"docs/metrics.md has no table row for {service}'s {family.name} " \
                        f"({family.kind})"
    known = set().union(*({f.name for f in r.families} | r.sample_names
                          for r in exported.values()))
    named = set(re.findall(r"`((?:fleet_collector|fleet_controlplane|process)_[a-z0-9_]+)",
                           text))
    assert named - known == set(), "docs/metrics.md names metrics no service exports"
