"""fleet_min.jsonio: orjson where it is installed, the json module's meaning either way.

Every value is compared with its type (1 and 1.0 and True are three different answers), and
every document orjson is not trusted with must be left to the standard library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_min import jsonio
from tests.support.collector import ROOT

needs_orjson = pytest.mark.skipif(not jsonio.FAST, reason="orjson is not installed")


def typed(value):
    """The value with the type of every part spelled out, so equal means the same JSON."""
    if isinstance(value, dict):
        return ("object", [(k, typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("array", [typed(v) for v in value])
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


scalars = (st.none() | st.booleans()
           | st.integers(min_value=-(10 ** 30), max_value=10 ** 30)
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.text())
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                         | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                         max_leaves=25)


def standard(raw: bytes):
    return json.loads(raw.decode("utf-8"))


@needs_orjson
@settings(max_examples=400, deadline=None)
@given(documents, st.booleans())
def test_a_body_orjson_takes_reads_as_the_json_module_reads_it(doc, ascii_only):
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    parsed, value = jsonio.loads_quick(raw)
    try:
        expected = standard(raw)
    except UnicodeDecodeError:  # a lone surrogate written raw: not UTF-8 at all
        assert not parsed
        return
    if parsed:
        assert typed(value) == typed(expected)
    assert typed(jsonio.loads_stored(raw.decode("utf-8"))) == typed(expected)
    assert typed(jsonio.loads_stored(raw)) == typed(expected)


@needs_orjson
@pytest.mark.parametrize("raw", [
    b'{"big": 123456789012345678901234567890}',  # orjson would make a float of it
    b'{"small": -9223372036854775809}',
    b'{"a": 1e400}',                                # infinity: the json module's decoder words it
    b'{"a": NaN}',
    b'"\\ud800"',                                   # a lone surrogate's escape
    b'{"a": 1,}',
    b'\xff\xfe{}',
])
def test_what_orjson_is_not_trusted_with_goes_to_the_json_module(raw):
    assert jsonio.loads_quick(raw) == (False, None)


def test_long_numbers_keep_every_digit_when_stored():
    text = '{"n": 123456789012345678901234567890, "m": [18446744073709551616]}'
    assert jsonio.loads_stored(text) == {"n": 123456789012345678901234567890,
                                         "m": [18446744073709551616]}


@settings(max_examples=300, deadline=None)
@given(documents)
def test_what_is_written_reads_back_the_same(doc):
    for text in (jsonio.dumps_stored(doc), jsonio.dumps_body(doc).decode("utf-8", "surrogatepass")):
        assert typed(json.loads(text)) == typed(doc)
    assert b" " not in jsonio.dumps_body({"a": [1, 2]})


def test_values_orjson_refuses_are_written_by_the_json_module():
    doc = {"n": 10 ** 25, "lone": "\ud800"}
    assert jsonio.dumps_stored(doc) == json.dumps(doc)
    assert json.loads(jsonio.dumps_body({1: "a"})) == {"1": "a"}
    assert jsonio.dumps_body({"n": 10 ** 25}) == b'{"n":10000000000000000000000000}'


def test_without_orjson_the_standard_library_answers_alone():
    """A real interpreter where orjson cannot be imported (fleet.pyz has none)."""
    script = (
        "import sys; sys.modules['orjson'] = None\n"
        "from fleet_min import jsonio\n"
        "assert not jsonio.FAST\n"
        "assert jsonio.loads_quick(b'{\"a\": 1}') == (False, None)\n"
        "assert jsonio.loads_stored('{\"a\": [1, 2.5]}') == {'a': [1, 2.5]}\n"
        "assert jsonio.dumps_stored({'a': 1}) == '{\"a\": 1}'\n"
        "assert jsonio.dumps_body({'a': 'é'}) == '{\"a\":\"é\"}'.encode()\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
