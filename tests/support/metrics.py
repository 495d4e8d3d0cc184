"""Reading GET /metrics in the tests with a real parser: prometheus_client's own reader of the
text format, so what passes here is what a Prometheus server takes."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

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
