"""The hand-written input checks at the services' edge, fuzzed with hypothesis for crashes.

tests/test_validate.py covers fleet_min/validate.py (the schema validators: crashes and
agreement with the JSON Schemas, on a corpus, its mutations and arbitrary JSON) and
tests/test_match.py the match-expression parser. What it does not reach are the other checks a
request passes through before any domain code runs: cron expressions, query integers and times,
snooze durations, artifact hashes, ranges and publish headers, topic names, schedule ids, the
control plane's live settings, host, runner and repository names, heartbeat reports, bearer
tokens and origins, the dashboard guard. Each must either accept the value (inside its bounds)
or refuse it with its own refusal (a sentence for a 4xx); any other exception is a 500.

The values are arbitrary JSON, with the inputs that broke such checks before always among them:
Unicode digits ('²' passes str.isdigit() and fails int(); '٣' passes both), integers past float
(10**400), NaN and infinities, and strings of 5,000 digits.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleet_min import cron, origin, query, timeutil, validate
from fleet_min.collector.access import guard
from fleet_min.collector.artifacts import store as artifacts
from fleet_min.collector.automation import alerts, schedules
from fleet_min.collector.insight import topics
from fleet_min.controlplane import settings as live
from fleet_min.controlplane.analysis import reports as analysis
from fleet_min.controlplane.federation import hosts as federation
from fleet_min.controlplane.http import auth
from fleet_min.controlplane.runners import discovery as runners
from fleet_min.errors import Refused

pytestmark = pytest.mark.fuzz

FUZZ = settings(max_examples=int(os.environ.get("FLEET_FUZZ_EXAMPLES", "300")), deadline=None,
                database=None, suppress_health_check=list(HealthCheck))

TRICKY_TEXT = ["\u00b2", "\u0663", "--5", "-0", "+1", " 1", "1 ", "1_0", "9" * 5000, "1e999",
               "nan", "inf", "-inf", "\x00", "0x10", "", " ", "\u00bd", "\uff11", "1" * 13,
               "*/\u00b2", "1-\u00b2", "\u00b2 * * * *", "@daily", "* * * * *", "0 0 30 feb *",
               "60 * * * *", "*/0 * * * *", "mon-fri", "jan"]
NUMBERS = st.one_of(st.integers(), st.integers(10**300, 10**500), st.integers(-(10**500), 0),
                    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(TRICKY_TEXT),
                 st.text(st.characters(categories=["Nd", "No", "Zs", "Pd"]), max_size=8),
                 st.text("0123456789-*/,@ abcdefghijklmnopqrstuvwxyz", max_size=30))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)


def refuses_or_returns(call: Any, *refusals: type[BaseException]) -> Any:
    """Run `call`; a refusal of the given kinds is fine (returned as None), anything else
    raises out of the test, which is what a 500 would have been."""
    try:
        return call()
    except (Refused, *refusals):
        return None


@FUZZ
@given(value=st.one_of(JSON, TEXT))
@example(value={}).via("a JSON object sent as the cron")
@example(value=["* * * * *"]).via("a JSON array sent as the cron")
@example(value="\u00b2 * * * *").via("a superscript digit")
@example(value="*/\u00b2 * * * *").via("a superscript step")
def test_cron_expressions_parse_or_refuse(value: Any) -> None:
    parsed = refuses_or_returns(lambda: cron.parse(value), cron.CronError)
    if parsed is not None:
        assert parsed.minutes and parsed.hours and parsed.months
    refuses_or_returns(lambda: schedules.check_cron(value))


@FUZZ
@given(raw=TEXT, low=st.integers(-5, 5), span=st.integers(0, 10**6))
@example(raw="\u00b2", low=1, span=100).via("a superscript digit")
@example(raw="--5", low=1, span=100).via("a doubled sign")
@example(raw="9" * 5000, low=1, span=100).via("past Python's int() digit limit")
def test_query_integers_are_in_bounds_or_refused(raw: str, low: int, span: int) -> None:
    value = refuses_or_returns(lambda: query.int_param({"n": raw}, "n", low, low, low + span))
    assert value is None or (isinstance(value, int) and low <= value <= low + span)
    refuses_or_returns(lambda: query.time_param({"t": raw}, "t"))
    refuses_or_returns(lambda: artifacts._page({"page": raw}))


@FUZZ
@given(raw=TEXT)
def test_times_parse_or_refuse_with_value_error(raw: str) -> None:
    value = refuses_or_returns(lambda: timeutil.parse_iso(raw), ValueError)
    assert value is None or math.isfinite(value)


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["duration_s", "minutes", "x"]), JSON, max_size=2))
@example(body={"duration_s": 10**400}).via("an integer past float")
@example(body={"minutes": -(10**400)}).via("a negative integer past float")
@example(body={"duration_s": math.nan}).via("NaN")
def test_snooze_durations_are_in_bounds_or_refused(body: dict[str, Any]) -> None:
    seconds = refuses_or_returns(lambda: alerts.snooze_seconds(body))
    assert seconds is None or 0 <= seconds <= alerts.MAX_SNOOZE_S


@FUZZ
@given(text=TEXT, header=st.one_of(st.none(), TEXT, st.builds(
    lambda a, b: f"bytes={a}-{b}", st.sampled_from(["", "0", "5", "-1", "9" * 30, "\u00b2"]),
    st.sampled_from(["", "0", "5", "9" * 30, "\u0663"]))), size=st.integers(0, 10**12),
    body=st.dictionaries(st.sampled_from(["reason", "accepted"]), JSON, max_size=2),
    headers=st.dictionaries(st.sampled_from(list(artifacts.PUBLISH_HEADERS.values())), TEXT,
                            max_size=3))
def test_artifact_inputs_are_checked(text: str, header: str | None, size: int,
                                     body: dict[str, Any], headers: dict[str, str]) -> None:
    assert refuses_or_returns(lambda: artifacts.check_sha256(text)) in (None, text)
    span = refuses_or_returns(lambda: artifacts.byte_range(header, size),
                              artifacts.RangeNotSatisfiable)
    if span is not None:
        first, last = span
        assert 0 <= first <= last < size
    refuses_or_returns(lambda: artifacts.check_reason(body))
    refuses_or_returns(lambda: artifacts.check_accepted(body))
    refuses_or_returns(lambda: artifacts.publish_fields(headers))


@FUZZ
@given(value=st.one_of(JSON, TEXT))
def test_names_are_checked(value: Any) -> None:
    if isinstance(value, str):
        refuses_or_returns(lambda: topics.check_topic(value))
        refuses_or_returns(lambda: topics.check_source(value))
        assert runners.valid_name(value) in (True, False)
    refuses_or_returns(lambda: topics.encode_payload(value))
    refuses_or_returns(lambda: schedules.check_id(value))
    refuses_or_returns(lambda: federation.check_host(value))
    refuses_or_returns(lambda: analysis.check_repo(value))
    refuses_or_returns(lambda: live.lookup(value))


@FUZZ
@given(key=st.sampled_from([s.key for s in live.LIVE_SETTINGS]), value=JSON)
@example(key="max_load_per_core", value=10**400).via("an integer past float")
@example(key="min_free_disk_gb", value=-(10**400)).via("a negative integer past float")
@example(key="ceiling", value=math.inf).via("infinity for an integer")
def test_live_settings_are_in_range_or_refused(key: str, value: Any) -> None:
    setting = live.lookup(key)
    checked = refuses_or_returns(lambda: setting.check(value))
    if checked is None:
        return
    if setting.choices:
        assert checked in setting.choices
    else:
        assert setting.low is not None and setting.high is not None
        assert setting.low <= checked <= setting.high and math.isfinite(checked)


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["runners", "capacity", "vitals", "load", "wait_s",
                                            "host"]), JSON, max_size=4),
       runner=st.dictionaries(st.sampled_from(list(federation.RUNNER_FIELDS)), JSON))
# An integer past a float's range: math.isfinite of it raised OverflowError (found at random).
@example(body={"load": [10**400]}, runner={})
@example(body={"load": [-(10**309), 0.5]}, runner={"busy": 10**400})
def test_heartbeat_reports_are_typed_or_refused(body: dict[str, Any],
                                                runner: dict[str, Any]) -> None:
    refuses_or_returns(lambda: federation.wait_of(body))
    for report in (body, {**body, "runners": [{**runner, "name": "r1"}]}):
        cleaned = refuses_or_returns(lambda report=report: federation.clean_report(report))
        if cleaned is None:
            continue
        for kept in cleaned["runners"]:
            assert isinstance(kept["name"], str)
            assert kept["busy"] in (True, False, None) and kept["draining"] in (True, False, None)
            assert kept["state"] is None or isinstance(kept["state"], str)
            assert kept["labels"] is None or all(isinstance(x, str) for x in kept["labels"])
        load = cleaned["load"]
        assert load is None or (len(load) <= 3 and all(
            x is None or (isinstance(x, float) and math.isfinite(x)) for x in load))


GATE = origin.HostGate("collector", ("collector.lan", "*.fleet.test"), {"pi"})
HEADER_VALUES = st.one_of(TEXT, st.sampled_from(["Bearer ", "bearer x", "Basic x", "Bearer  x ",
                                                 "cross-site", "same-origin", "null",
                                                 "http://127.0.0.1:7878", "file://", "http://",
                                                 "127.0.0.1:7878", "[::1]", "[x]:1", "a.fleet.test",
                                                 "text/plain", "0", "12"]))


@FUZZ
@given(headers=st.dictionaries(st.sampled_from(["Authorization", "Origin", "Host",
                                                "Sec-Fetch-Site", "X-Fleet-Token",
                                                "Content-Type", "Content-Length"]),
                               HEADER_VALUES, max_size=5),
       method=st.sampled_from(["GET", "POST", "PATCH", "DELETE", "PUT", "HEAD", "get", ""]),
       path=TEXT, need=st.sampled_from(list(auth.Need)), read_only=st.booleans())
def test_tokens_and_origins_are_checked(headers: dict[str, str], method: str, path: str,
                                        need: auth.Need, read_only: bool) -> None:
    who = refuses_or_returns(lambda: auth.authorize(need, headers, read_only=read_only,
                                                    control="c" * 64, agent="a" * 64))
    assert who is None or isinstance(who, str)
    refuses_or_returns(lambda: guard.check(method, path, path, headers, "token"))
    refuses_or_returns(lambda: guard.check(method, None, path, headers, None))
    refuses_or_returns(lambda: origin.check_request(method, headers, "collector", "no"))
    refuses_or_returns(lambda: GATE.check(headers.get("Host")))


@FUZZ
@given(doc=JSON, key=st.sampled_from(["api_key", "password", "prompt_tokens", "token_id", "x"]))
def test_scanners_take_any_json(doc: Any, key: str) -> None:
    for value in (doc, {key: doc}, [{"params": {key: doc}}]):
        refs = validate.find_template_refs(value)
        assert all(isinstance(job_id, str) for job_id, _kind, _metric in refs)
        for path in validate.find_secret_keys(value):
            assert isinstance(path, str) and path
