"""The boundary rules of fleet_min/origin.py as plain functions: Host names, origins, body types."""

from __future__ import annotations

import pytest

from fleet_min import origin
from fleet_min.errors import BadRequest, Forbidden, Misdirected, UnsupportedMediaType


@pytest.mark.parametrize("value, expected", [
    ("example.lan", ("example.lan", None)), ("Example.LAN.:8788", ("example.lan", 8788)),
    ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:7878", ("::1", 7878)), ("[::1]", ("::1", None)),
    ("host:", ("host", None)), ("  pi  ", ("pi", None)),
])
def test_split_host(value: str, expected: tuple[str, int | None]) -> None:
    assert origin.split_host(value) == expected


@pytest.mark.parametrize("value", ["", ":80", "::1", "[::1", "[pi]:80", "[::1]x", "pi:http",
                                   "pi:99999", "a b", "pi/x", "user@pi", "pi:80:80", ".", "-"])
def test_split_host_refuses_what_is_not_a_host(value: str) -> None:
    assert origin.split_host(value) is None


def test_host_patterns_parse_and_refuse() -> None:
    assert origin.host_patterns(" Collector.LAN., *.fleet.test ,,10.0.0.2, *") == (
        "collector.lan", "*.fleet.test", "10.0.0.2", "*")
    for bad in ("http://x", "a b", "*x.lan", "x/y", "*.*.lan"):
        with pytest.raises(ValueError, match="host names or"):
            origin.host_patterns(bad)


def gate(*patterns: str) -> origin.HostGate:
    return origin.HostGate("collector", patterns, {"pi", "pi.local"})


def test_the_gate_answers_to_known_names_only() -> None:
    checked = gate("collector.lan", "*.fleet.test")
    for host in (None, "", "127.0.0.1:1", "[fe80::1]", "localhost", "a.localhost:9", "PI:8788",
                 "pi.local", "collector.lan", "x.y.fleet.test:1"):
        checked.check(host)
    for host in ("fleet.test", "evil.example", "pi.evil.example", "localhost.evil.example"):
        with pytest.raises(Misdirected, match=f"'{host}'; add it to FLEET_ALLOWED_HOSTS"):
            checked.check(host)
    with pytest.raises(BadRequest, match="Host header"):
        checked.check("a b")
    gate("*").check("anything.example")


def test_the_gate_admits_a_name_later_and_keeps_its_memory_bounded() -> None:
    checked = gate()
    with pytest.raises(Misdirected):
        checked.check("fleet-col-1.local")
    checked.admit("Fleet-Col-1.local.")
    checked.check("fleet-col-1.local:8788")
    for port in range(3 * origin.HostGate.CACHE_LIMIT):
        checked.check(f"127.0.0.1:{port}")
    assert len(checked._admitted) <= origin.HostGate.CACHE_LIMIT


@pytest.mark.parametrize("value, host, same", [
    ("http://127.0.0.1:8788", "127.0.0.1:8788", True),
    ("http://LOCALHOST:8788", "localhost:8788", True),
    ("http://pi", "pi:80", True), ("https://pi", "pi", True), ("https://pi:443", "pi", True),
    ("http://[::1]:7878", "[::1]:7878", True),
    ("http://pi", "pi:8788", False), ("http://evil.example:8788", "pi:8788", False),
    ("null", "pi", False), ("file://", "pi", False), ("http://", "pi", False),
    ("http://pi:bad", "pi", False), ("http://[", "pi", False), ("http://pi", "", False),
])
def test_same_origin(value: str, host: str, same: bool) -> None:
    assert origin.same_origin(value, host) is same


def test_check_request_applies_to_changes_only() -> None:
    foreign = {"Origin": "http://evil.example", "Host": "pi", "Content-Type": "text/plain"}
    origin.check_request("GET", foreign, "collector", "no")
    with pytest.raises(Forbidden, match="no"):
        origin.check_request("DELETE", foreign, "collector", "no")
    same = {**foreign, "Origin": "http://pi"}
    with pytest.raises(UnsupportedMediaType, match="refuses text/plain"):
        origin.check_request("POST", same, "collector", "no")
    origin.check_request("POST", {**same, "Content-Type": "application/json"}, "collector", "no")


@pytest.mark.parametrize("headers, refused", [
    ({}, False), ({"Sec-Fetch-Site": "same-origin"}, False), ({"Sec-Fetch-Site": "none"}, False),
    ({"Sec-Fetch-Site": " Same-Origin "}, False),
    ({"Sec-Fetch-Site": "same-origin", "Referer": "http://evil.example/"}, False),  # trusted
    ({"Referer": "http://pi:8788/runner"}, False), ({"Origin": "http://pi:8788"}, False),
    ({"Sec-Fetch-Site": "cross-site"}, True), ({"Sec-Fetch-Site": "same-site"}, True),
    ({"Sec-Fetch-Site": "bogus"}, True), ({"Referer": "http://evil.example/"}, True),
    ({"Referer": "http://pi:9999/"}, True), ({"Referer": "not a url"}, True),
    ({"Origin": "null"}, True), ({"Origin": "http://evil.example"}, True),
    ({"Sec-Fetch-Site": "same-origin", "Origin": "http://pi:1"}, True),
])
def test_a_claiming_read_asked_for_by_another_page(headers: dict[str, str],
                                                    refused: bool) -> None:
    headers = {"Host": "pi:8788", **headers}
    assert origin.from_a_page(headers) is (len(headers) > 1)
    if refused:
        with pytest.raises(Forbidden, match="elsewhere"):
            origin.check_page_read(headers, "elsewhere")
    else:
        origin.check_page_read(headers, "elsewhere")


@pytest.mark.parametrize("headers, refused", [
    ({"Content-Type": "text/plain"}, True), ({"Content-Type": "TEXT/PLAIN; charset=x"}, True),
    ({"Content-Type": "application/x-www-form-urlencoded"}, True),
    ({"Content-Type": "multipart/form-data; boundary=x"}, True),
    ({"Content-Length": "2"}, True), ({"Transfer-Encoding": "chunked"}, True),
    ({"Content-Type": "", "Content-Length": "2"}, True),
    ({}, False), ({"Content-Length": "0"}, False), ({"Content-Type": "application/json"}, False),
    ({"Content-Type": "application/octet-stream", "Content-Length": "9"}, False),
    ({"Content-Type": "text/plain, application/json"}, False),  # a browser would preflight it
])
def test_body_types(headers: dict[str, str], refused: bool) -> None:
    if refused:
        with pytest.raises(UnsupportedMediaType, match="send the body as application/json"):
            origin.check_body_type(headers, "collector")
    else:
        origin.check_body_type(headers, "collector")
