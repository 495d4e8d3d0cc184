"""The Prometheus text renderer (fleet_min/metrics.py), read back with prometheus_client's
parser: escaping, cumulative histogram buckets, +Inf, no NaN ever, names checked."""

from __future__ import annotations

import math
import os
import time

import pytest

from fleet_min import metrics
from tests.support.metrics import parse


def test_label_values_and_help_are_escaped_and_read_back_unchanged():
    registry = metrics.Registry()
    tricky = 'back\\slash "quoted"\nnew line, {braces}=, émoji 🚀'
    counter = registry.counter("odd_total", 'help with \\ and "quotes"\nand a second line',
                               ["kind"])
    counter.labels(tricky).inc(3)
    registry.gauge("plain", "g", ["a", "b"], read=lambda: [(("x", ""), 1.5)])
    text = registry.render()
    assert 'kind="back\\\\slash \\"quoted\\"\\nnew line' in text
    assert "# HELP odd_total help with \\\\ and \"quotes\"\\nand a second line" in text
    scrape = parse(text)
    assert scrape.value("odd_total", kind=tricky) == 3
    assert scrape.families["odd"].documentation == 'help with \\ and "quotes"\nand a second line'
    assert scrape.value("plain", a="x", b="") == 1.5
    assert scrape.type_of("odd") == "counter" and scrape.type_of("plain") == "gauge"


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    registry = metrics.Registry()
    hist = registry.histogram("wait_seconds", "w", [0.1, 1, 10], ["executor"])
    device = hist.labels("device")
    for value in (0.05, 0.1, 0.5, 1.0, 5, 50, 500):  # 0.1 and 1.0 sit on bounds: le counts them
        device.observe(value)
    hist.labels("host")  # a series with no observations yet
    scrape = parse(registry.render())
    assert scrape.type_of("wait_seconds") == "histogram"
    assert scrape.buckets("wait_seconds", executor="device") == {
        "0.1": 2, "1.0": 4, "10.0": 5, "+Inf": 7}
    assert scrape.value("wait_seconds_count", executor="device") == 7
    assert scrape.value("wait_seconds_sum", executor="device") == pytest.approx(556.65)
    assert scrape.buckets("wait_seconds", executor="host") == {
        "0.1": 0, "1.0": 0, "10.0": 0, "+Inf": 0}
    assert scrape.value("wait_seconds_count", executor="host") == 0


def test_a_histogram_read_at_scrape_is_built_from_the_observations_each_time():
    ages = [1.0, 20.0, 20.0]
    registry = metrics.Registry()
    registry.histogram("age_seconds", "a", [5, 30], read=lambda: [((), ages)])
    assert parse(registry.render()).buckets("age_seconds") == {"5.0": 1, "30.0": 3, "+Inf": 3}
    ages[:] = [100.0]
    scrape = parse(registry.render())
    assert scrape.buckets("age_seconds") == {"5.0": 0, "30.0": 0, "+Inf": 1}
    assert scrape.value("age_seconds_sum") == 100


def test_nan_is_never_emitted_and_infinities_are_spelled_out():
    registry = metrics.Registry()
    registry.gauge("maybe", "m", ["k"], read=lambda: [(("nan",), math.nan), (("inf",), math.inf),
                                                     (("minf",), -math.inf), (("ok",), 2)])
    hist = registry.histogram("h_seconds", "h", [1])
    hist.observe(math.nan)  # ignored: it would make the sum NaN for good
    hist.observe(0.5)
    both = registry.histogram("both_seconds", "b", [1])
    both.observe(math.inf)
    both.observe(-math.inf)  # the sum is now inf + -inf: left out rather than sent as NaN
    text = registry.render()
    assert "nan" not in text.lower().replace('k="nan"', "")
    assert 'maybe{k="nan"}' not in text
    assert 'maybe{k="inf"} +Inf' in text and 'maybe{k="minf"} -Inf' in text
    scrape = parse(text)
    assert scrape.value("maybe", k="inf") == math.inf
    assert scrape.value("h_seconds_count") == 1 and scrape.value("h_seconds_sum") == 0.5
    assert not scrape.has("both_seconds_sum")
    assert scrape.value("both_seconds_count") == 2


def test_values_keep_integers_exact():
    registry = metrics.Registry()
    registry.gauge("bytes", "b", read=lambda: [((), 2**53 + 1)])
    text = registry.render()
    assert f"bytes {2**53 + 1}\n" in text
    assert metrics.format_value(0.25) == "0.25" and metrics.format_value(3) == "3"


def test_names_labels_and_buckets_are_checked_when_a_family_is_made():
    registry = metrics.Registry()
    for bad in ("9lives", "with-dash", "", "sp ace"):
        with pytest.raises(ValueError):
            registry.gauge(bad, "x")
    with pytest.raises(ValueError):
        registry.gauge("ok_name", "x", ["__reserved"])
    with pytest.raises(ValueError):
        registry.gauge("ok_name", "x", ["a", "a"])
    with pytest.raises(ValueError):
        registry.histogram("h", "x", [1], ["le"])
    with pytest.raises(ValueError):
        registry.histogram("h", "x", [5, 1])
    with pytest.raises(ValueError):
        registry.histogram("h", "x", [])
    registry.histogram("taken_seconds", "x", [1])
    for clash in ("taken_seconds", "taken_seconds_count", "taken_seconds_bucket"):
        with pytest.raises(ValueError):
            registry.gauge(clash, "x")
    counter = registry.counter("c_total", "x", ["kind"])
    with pytest.raises(ValueError):
        counter.labels()  # one label value is needed
    with pytest.raises(ValueError):
        registry.counter("plain_total", "x").inc(-1)
    with pytest.raises(TypeError):
        registry.gauge("read_only", "x", read=list).labels()


def test_process_figures_come_from_the_process_itself():
    registry = metrics.Registry()
    started = time.time()
    metrics.add_process(registry, started)
    scrape = parse(registry.render())
    assert scrape.value("process_start_time_seconds") == started
    assert scrape.value("process_cpu_seconds_total") > 0
    assert scrape.value("process_open_fds") >= 3  # stdin, stdout, stderr at least
    if os.path.exists("/proc/self/statm"):
        assert scrape.value("process_resident_memory_bytes") > 1 << 20
    assert scrape.type_of("process_cpu_seconds") == "counter"
