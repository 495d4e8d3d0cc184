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


@settings(max_examples=200, deadline=None)
@given(st.lists(documents, max_size=6), st.sampled_from([None, "items", "\ud800 \"odd\""]))
def test_a_listing_made_an_item_at_a_time_is_the_body_of_the_whole(items, key):
    """The same JSON (not always the same bytes: one item orjson refuses is written by the
    json module alone, where the whole would have taken every item there)."""
    whole = jsonio.dumps_body(items if key is None else {key: items})
    made = jsonio.dumps_listing(iter(items), key)
    assert typed(json.loads(made.decode("utf-8", "surrogatepass"))) == typed(
        json.loads(whole.decode("utf-8", "surrogatepass")))
    assert b" " not in jsonio.dumps_listing([[1, 2], {"a": 3}], "k")


def test_values_orjson_refuses_are_written_by_the_json_module():
    doc = {"n": 10 ** 25, "lone": "\ud800"}
    assert jsonio.dumps_stored(doc) == json.dumps(doc)
    assert json.loads(jsonio.dumps_body({1: "a"})) == {"1": "a"}
    assert jsonio.dumps_body({"n": 10 ** 25}) == b'{"n":10000000000000000000000000}'


def test_nan_and_infinities_go_out_as_null_never_as_bare_words():
    """The json module would write NaN and Infinity, which no JSON parser takes; a body is JSON
    with orjson and without it (the test below runs the same check with no orjson)."""
    body = jsonio.dumps_body({"m": float("inf"), "l": [float("nan"), 1.5, (-float("inf"),)]})
    assert body == b'{"m":null,"l":[null,1.5,[null]]}'
    assert jsonio.dumps_body({"big": 10 ** 25, "x": float("nan")}) == (
        b'{"big":10000000000000000000000000,"x":null}')  # the json module's path, with orjson


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
        "inf, nan = float('inf'), float('nan')\n"
        "assert jsonio.dumps_body({'m': inf, 'l': [nan, 1.5, (-inf,)]}) == "
        "b'{\"m\":null,\"l\":[null,1.5,[null]]}'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# Which orjson is trusted


def _fake_orjson(folder, version: str):
    """A stand-in `orjson` module of the given version (the json module underneath), put first
    on a subprocess's path: what an old wheel left on a machine looks like to jsonio."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "orjson.py").write_text(
        f"__version__ = {version!r}\n"
        "import json\n"
        "class JSONDecodeError(ValueError):\n    pass\n"
        "def loads(raw):\n    return json.loads(raw)\n"
        "def dumps(value):\n    return json.dumps(value).encode()\n")
    return folder


def _jsonio_in(pythonpath: str) -> list[str]:
    script = ("from fleet_min import jsonio\n"
              "print(jsonio.FAST, jsonio.orjson is not None)\nprint(jsonio.REFUSED)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize("version", ["3.8.3", "3.9.14", "3.11.5", "", "not-a-version"])
def test_an_orjson_older_than_the_floor_is_not_used(tmp_path, version):
    fake = _fake_orjson(tmp_path / "old", version)
    fast, reason = _jsonio_in(f"{fake}:{ROOT}")
    assert fast == "False False"
    assert "not used" in reason and "3.11.6" in reason and "deeply nested" in reason


@pytest.mark.parametrize("version", ["3.11.6", "3.12.0", "4.0.0rc1"])
def test_an_orjson_at_or_past_the_floor_is_used(tmp_path, version):
    fake = _fake_orjson(tmp_path / "new", version)
    assert _jsonio_in(f"{fake}:{ROOT}") == ["True True", "None"]


def test_the_installed_orjson_is_judged_by_its_version():
    try:
        import orjson
    except ImportError:
        pytest.skip("orjson is not installed")
    trusted = jsonio._release(orjson.__version__) >= jsonio.ORJSON_FLOOR
    assert jsonio.FAST is trusted and (jsonio.REFUSED is None) is trusted


# ---------------------------------------------------------------------------------------------
# Nesting


def depth_of(value) -> int:
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            level += 1
            deepest = max(deepest, level)
            stack.extend((child, level) for child in (
                item.values() if isinstance(item, dict) else item))
    return deepest


# Strings full of what a naive count would take for structure: brackets, quotes, backslashes.
tricky_text = st.text(alphabet='[]{}"\\ ax\u00e9', max_size=6)
nested_docs = st.recursive(
    st.none() | st.integers() | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=40)


@settings(max_examples=500, deadline=None)
@given(nested_docs, st.booleans(), st.integers(min_value=0, max_value=8))
def test_too_deep_agrees_with_the_parsed_depth(doc, ascii_only, limit):
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert jsonio.too_deep(raw, limit) == (depth_of(doc) > limit)


@pytest.mark.parametrize("raw, deep", [
    (b"[" * 64 + b"]" * 64, False),
    (b"[" * 65 + b"]" * 65, True),
    (b'{"a":' * 65 + b"1" + b"}" * 65, True),
    (b"[" * 200_000, True),                                  # never closed
    (b"[[]," * 70 + b"1" + b"]" * 70, True),                 # a sibling at every level
    (b"[" + b"[[]]," * 10_000 + b"1]", False),               # wide, not deep
    (b'["' + b"[" * 5_000 + b'"]', False),                    # brackets in a string
    (b'["\\\\", "\\"[[[[", ' + b"[" * 63 + b"]" * 63 + b"]", False),
    (b'["\\\\", "\\"[[[[", ' + b"[" * 64 + b"]" * 64 + b"]", True),
])
def test_too_deep_at_the_edges(raw, deep):
    assert jsonio.too_deep(raw) is deep


def test_foreign_json_is_refused_by_its_depth_before_any_parser_recurses() -> None:
    for deep in (b"[" * 100_000, "{\"a\": " * 65 + "1" + "}" * 65):
        with pytest.raises(jsonio.TooDeep):
            jsonio.loads_foreign(deep)
    with pytest.raises(ValueError):
        jsonio.loads_foreign(b"<html>")
    assert jsonio.loads_foreign("[" * 64 + "]" * 64) == jsonio.loads_foreign(
        b"[" * 64 + b"]" * 64)
    assert jsonio.loads_foreign('{"message": "\\ud800"}') == {"message": "\ud800"}
    for constant in (b'{"n": NaN}', b"[Infinity]", b"[-Infinity]"):
        with pytest.raises(ValueError, match="is not JSON"):
            jsonio.loads_foreign(constant, constants=False)
        assert jsonio.loads_foreign(constant)  # a reader that cleans each value takes them
