"""Reading GET /metrics in the tests with a real parser: prometheus_client's own reader of the
text format, so what passes here is what a Prometheus server takes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fleet_min import metrics
from fleet_min.collector.insight.telemetry import CollectorMetrics
from fleet_min.controlplane.federation.hosts import Hosts
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.telemetry import ControlPlaneMetrics
from fleet_min.db import Database
from fleet_min.sse import EventHub

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Scrape:
    """One scrape, parsed: families by name (the parser drops a counter's _total from its
    family name; sample names keep it) and a look-up of one sample's value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples = [sample for family in self.families.values() for sample in family.samples]

    def type_of(self, family: str) -> str:
        return str(self.families[family].type)

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample of that sample name, by its labels."""
        return {tuple(sorted(s.labels.items())): s.value for s in self.samples if s.name == name}

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples in\n{self.text}"
        return float(found[0])

    def has(self, name: str, **labels: str) -> bool:
        return any(s.name == name and s.labels == labels for s in self.samples)

    def buckets(self, name: str, **labels: str) -> dict[str, float]:
        """A histogram's cumulative bucket counts by their le."""
        return {s.labels["le"]: s.value for s in self.samples if s.name == f"{name}_bucket"
                and {k: v for k, v in s.labels.items() if k != "le"} == labels}


def parse(text: str) -> Scrape:
    return Scrape(text)


def check_reply(status: int, headers: Any, text: str) -> Scrape:
    assert status == 200, text
    assert headers["Content-Type"] == CONTENT_TYPE
    assert "NaN" not in text
    return Scrape(text)


def registries(tmp: Path) -> dict[str, metrics.Registry]:
    """The registries of both services, built on real (unopened) parts: what each one's
    GET /metrics renders, family by family."""
    collector = CollectorMetrics(Database(tmp / "collector.sqlite3", []), EventHub(),
                                 lambda: 0, time.time())
    hosts = Hosts(Database(tmp / "controlplane.db", []), time.time)
    controlplane = ControlPlaneMetrics(dict, GitHub("http://127.0.0.1:9", None), hosts,
                                       EventHub(latest_only=True), lambda: 60.0, time.time,
                                       time.time())
    return {"collector": collector.registry, "controlplane": controlplane.registry}
