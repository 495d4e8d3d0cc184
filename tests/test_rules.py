"""Pure queue rules: windows, constraints, capabilities, status, platform inference."""

from __future__ import annotations

import pytest

from fleet_min.collector.jobs import rules


@pytest.mark.parametrize("start, end, hour, inside", [
    (9, 17, 9, True), (9, 17, 16, True), (9, 17, 17, False), (9, 17, 3, False),
    (22, 6, 23, True), (22, 6, 0, True), (22, 6, 5, True), (22, 6, 6, False),
    (22, 6, 12, False), (5, 5, 13, True),
])
def test_window(start, end, hour, inside):
    assert rules.in_window({"from": start, "to": end}, hour) is inside


def test_constraints_fail_closed_without_a_fresh_beacon():
    now = 10_000.0
    assert rules.constraint_refusal({"require_ac": True}, None, None, now)
    assert rules.constraint_refusal({"max_load": 2}, {"load": 1}, now - 600, now)
    assert rules.constraint_refusal({"max_load": 2}, {"load": 1}, now - 5, now) is None
    assert rules.constraint_refusal({"require_charging": True}, None, None, now) is None
    assert rules.constraint_refusal({}, None, None, now) is None


def test_require_ac_holds_on_mains_power_or_charging():
    """decisions.md: require_ac holds when on_ac or charging is true; ac is on_ac's alias;
    unknown (null) fails closed."""
    now = 1.0
    held = [{"charging": True}, {"on_ac": True}, {"ac": True}, {"on_ac": False, "charging": True},
            {"ac": False, "charging": True}, {"on_ac": None, "charging": True},
            {"on_ac": True, "ac": False}]
    refused = [{}, {"charging": False}, {"on_ac": False}, {"on_ac": None}, {"ac": None},
               {"on_ac": None, "ac": True}, {"on_ac": "yes"}, {"charging": None}]
    for beacon in held:
        assert rules.constraint_refusal({"require_ac": True}, beacon, now, now) is None, beacon
    for beacon in refused:
        assert rules.constraint_refusal({"require_ac": True}, beacon, now, now), beacon


def test_load_and_idle_read_the_field_names_with_aliases_and_fail_closed_on_null():
    now = 1.0
    assert rules.constraint_refusal({"max_load": 1.0}, {"load_1m": 0.5}, now, now) is None
    assert rules.constraint_refusal({"max_load": 1.0}, {"load": 0.5}, now, now) is None
    assert rules.constraint_refusal({"max_load": 1.0}, {"load_1m": 0.5, "load": 9}, now,
                                    now) is None
    for beacon in ({"load_1m": 2.0}, {"load_1m": None}, {"load_1m": None, "load": 0.1}, {}):
        assert rules.constraint_refusal({"max_load": 1.0}, beacon, now, now) == "load too high"
    assert rules.constraint_refusal({"require_idle_s": 60}, {"idle_s": 60}, now, now) is None
    for beacon in ({"idle_s": 59}, {"idle_s": None}, {}):
        assert rules.constraint_refusal({"require_idle_s": 60}, beacon, now, now)


def test_booleans_are_not_loads():
    assert rules.constraint_refusal({"max_load": 5}, {"load": True}, 1.0, 1.0)


def test_offers():
    assert rules.offers(None, "batch", None)
    assert not rules.offers([], "batch", None)
    assert rules.offers(["benchmark"], "benchmark", "jssha")
    assert rules.offers(["benchmark:jssha"], "benchmark", "jssha")
    assert not rules.offers(["benchmark:jssha"], "benchmark", "webcrypto")
    assert not rules.offers(["benchmark:jssha"], "benchmark", None)
    assert rules.declared_workloads(["benchmark:jssha", "build:gradle", "self-check"]) == [
        "benchmark", "build", "self-check"]


def test_offers_is_the_capability_names_rule_for_every_combination():
    declarations = ["benchmark", "benchmark:jssha", "build", "build:", ":jssha", "batch:x"]
    lists = [[]] + [[d] for d in declarations] + [declarations[:3], declarations[2:]]
    for capabilities in lists:
        for workload in ("benchmark", "build", "batch", ""):
            for backend in (None, "", "jssha", "x"):
                expected = any(name in set(capabilities)
                               for name in rules.capability_names(workload, backend))
                assert rules.offers(capabilities, workload, backend) is expected
                assert rules.offers(iter(capabilities), workload, backend) is expected


def test_status_and_expiry():
    assert rules.device_status(100, 100 + 179) == "online"
    assert rules.device_status(100, 100 + 181) == "stale"
    assert rules.device_status(100, 100 + 901) == "offline"
    assert rules.is_expired(60, 0, 61) and not rules.is_expired(None, 0, 10**9)


def test_platform_inference():
    assert rules.infer_platform("iOS 17.2") == "ios"
    assert rules.infer_platform("iPadOS 18") == "ios"
    assert rules.infer_platform("Android 14") == "android"
    assert rules.infer_platform(None) == "android"
