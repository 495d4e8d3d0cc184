"""Match expressions (targets.match): grammar, semantics, limits and regex safety."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet_min.collector.jobs import match
from fleet_min.collector.jobs.match import Matcher, MatchError, compile_match, compiled

PIXEL: dict[str, Any] = {
    "device_id": "pixel-8",
    "platform": "android",
    "kind": "phone",
    "model": "Pixel 8",
    "soc": "Google Tensor G3",
    "os": "Android 14",
    "arch": "arm64",
    "app_ver": "1.10",
    "ram_mb": 8192,
    "cpu_cores": 9,
    "gpu": None,
    "pools": ["lab", "android"],
    "capabilities": ["benchmark:jssha", "self-check"],
}
IPHONE: dict[str, Any] = {
    "device_id": "iphone-12",
    "platform": "ios",
    "kind": "phone",
    "model": "iPhone 12",
    "soc": "Apple A14",
    "ram_mb": 4096,
    "pools": ["labs"],
    "capabilities": None,
}
PI: dict[str, Any] = {
    "device_id": "pi-4",
    "platform": "linux",
    "kind": "sbc",
    "soc": "Broadcom BCM2711",
    "ram_mb": 8192.0,
    "vram_mb": 0,
    "pools": [],
    "capabilities": [],
}


def selects(expression: str, view: dict[str, Any]) -> bool:
    return compile_match(expression).evaluate(view)


def refusal(expression: str) -> MatchError:
    with pytest.raises(MatchError) as caught:
        compile_match(expression)
    return caught.value


# --------------------------------------------------------------------------- examples


def test_documented_examples() -> None:
    memory = compile_match("ram_mb >= 8192 && platform == 'android'")
    assert [memory.evaluate(d) for d in (PIXEL, IPHONE, PI)] == [True, False, False]
    jssha = compile_match("capabilities ~ 'benchmark:jssha'")
    assert [jssha.evaluate(d) for d in (PIXEL, IPHONE, PI)] == [True, False, False]
    socs = compile_match("soc ~ 'snapdragon|tensor'")
    assert [socs.evaluate(d) for d in (PIXEL, IPHONE, PI)] == [True, False, False]
    assert selects("soc ~ 'snapdragon|tensor'", {"soc": "Qualcomm SNAPDRAGON 8 Gen 2"})


# --------------------------------------------------------------------------- operators


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("platform == 'android'", True),
        ("platform == 'ios'", False),
        ("platform != 'ios'", True),
        ("platform != 'android'", False),
        ("ram_mb < 8193", True),
        ("ram_mb < 8192", False),
        ("ram_mb <= 8192", True),
        ("ram_mb <= 8191", False),
        ("ram_mb > 8191", True),
        ("ram_mb > 8192", False),
        ("ram_mb >= 8192", True),
        ("ram_mb >= 8193", False),
        ("model ~ 'pixel [6-9]'", True),
        ("model ~ 'pixel [1-5]'", False),
        ("platform == 'Android'", False),  # == is case-sensitive; ~ is not
        ("platform ~ '^ANDROID$'", True),
        ("cpu_cores > 8 && cpu_cores < 10", True),
    ],
)
def test_each_operator(expression: str, expected: bool) -> None:
    assert selects(expression, PIXEL) is expected


def test_tilde_is_a_search_not_a_full_match() -> None:
    assert selects("os ~ 'droid'", PIXEL)
    assert selects("os ~ '1[3-5]$'", PIXEL)
    assert not selects("os ~ '^14'", PIXEL)


def test_tilde_searches_only_the_first_256_characters() -> None:
    view = {"notes": "x" * 251 + "needle" + "y" * 100}
    assert not selects("notes ~ 'needle'", view)
    assert selects("notes ~ 'needl'", view)  # "needl" ends at character 256
    assert selects("notes ~ '^x{100}'", view)


def test_tilde_left_side_may_be_a_literal() -> None:
    assert selects("'Pixel 8 Pro' ~ 'pro$'", {})
    assert selects("8192 ~ '^8'", {})


# --------------------------------------------------------------------------- precedence


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # && binds tighter than ||
        ("platform == 'ios' || platform == 'android' && ram_mb > 100000", False),
        ("(platform == 'ios' || platform == 'android') && ram_mb > 1", True),
        ("platform == 'android' || platform == 'ios' && ram_mb > 100000", True),
        ("ram_mb > 100000 && platform == 'ios' || kind == 'phone'", True),
        ("ram_mb > 100000 && (platform == 'ios' || kind == 'phone')", False),
        # ! binds tightest: it takes the field or group next to it
        ("!gpu && kind == 'phone'", True),
        ("!kind || platform == 'android'", True),
        ("!(kind == 'phone' && platform == 'android')", False),
        ("!(kind == 'phone') || platform == 'android'", True),
        ("!!kind", True),
        ("!!!kind", False),
        ("!(!(kind))", True),
        ("((((platform == 'android'))))", True),
        ("!true || false", False),
        ("true && !false", True),
    ],
)
def test_precedence_and_parentheses(expression: str, expected: bool) -> None:
    assert selects(expression, PIXEL) is expected


def test_whitespace_is_free() -> None:
    assert selects("ram_mb>=8192&&platform=='android'", PIXEL)
    assert selects("\n\tram_mb >=\t8192\r\n&&\nplatform == 'android'  ", PIXEL)


# --------------------------------------------------------------------------- literals


@pytest.mark.parametrize(
    ("expression", "view"),
    [
        ("name == 'it''s'", None),  # adjacent strings are a syntax error, checked below
        (r"name == 'it\'s'", {"name": "it's"}),
        (r'name == "it\"s"', {"name": 'it"s'}),
        ('name == "it\'s"', {"name": "it's"}),
        ("name == 'say \"hi\"'", {"name": 'say "hi"'}),
        (r"name == 'back\\slash'", {"name": "back\\slash"}),
        (r"name == 'C:\temp'", {"name": "C:\\temp"}),  # unknown escapes are kept
        ("name == 'a && b || !c ( )'", {"name": "a && b || !c ( )"}),
        ("name == ''", {"name": ""}),
        ("name == 'Ünïcødé ✓'", {"name": "Ünïcødé ✓"}),
    ],
)
def test_strings_and_escapes(expression: str, view: dict[str, Any] | None) -> None:
    if view is None:
        refusal(expression)
    else:
        assert selects(expression, view)


def test_backslashes_reach_the_regex_unchanged() -> None:
    assert selects(r"app_ver ~ '^\d+\.\d+$'", PIXEL)
    assert selects(r"app_ver ~ '^\\d+\\.\\d+$'", PIXEL)  # \\ is one backslash
    assert not selects(r"app_ver ~ '^\d+\.\d+$'", {"app_ver": "1x10"})
    assert selects(r"path ~ '\\\\'", {"path": "a\\b"})  # a literal backslash


@pytest.mark.parametrize(
    ("expression", "view", "expected"),
    [
        ("ram_mb == 8192", {"ram_mb": 8192}, True),
        ("ram_mb == '8192'", {"ram_mb": 8192}, True),
        ("ram_mb == 8192", {"ram_mb": 8192.0}, True),
        ("ram_mb == 8192", {"ram_mb": "8192"}, True),
        ("ram_mb == 8192.0", {"ram_mb": 8192}, True),
        ("ram_mb == '8192.0'", {"ram_mb": 8192}, False),
        ("ram_mb >= 8000", {"ram_mb": "8192"}, True),
        ("ram_mb >= 8000", {"ram_mb": "8 GB"}, False),
        ("ram_mb < 8000", {"ram_mb": "8 GB"}, False),
        ("ram_mb >= 8000", {"ram_mb": True}, False),
        ("ram_mb >= '8000'", {"ram_mb": 8192}, True),
        ("ram_mb >= 'lots'", {"ram_mb": 8192}, False),
        ("load <= 0.1", {"load": 0.1}, True),
        ("load < 0.75", {"load": 0.5}, True),
        ("load == 0.5", {"load": 0.5}, True),
        ("load == '0.5'", {"load": 0.5}, True),
        ("temp > -10", {"temp": -3}, True),
        ("temp < -10.5", {"temp": -11}, True),
        ("temp == -3", {"temp": -3.0}, True),
        ("app_ver == 1.10", {"app_ver": "1.10"}, False),  # the literal reads as 1.1
        ("app_ver == '1.10'", {"app_ver": "1.10"}, True),
        ("app_ver > 1.9", {"app_ver": "1.10"}, False),  # numbers, not versions
        ("charging == true", {"charging": True}, True),
        ("charging == 'true'", {"charging": True}, True),
        ("charging == false", {"charging": True}, False),
        ("charging != false", {"charging": True}, True),
        ("charging > 0", {"charging": True}, False),  # booleans are not numbers
        ("big > 1", {"big": 10**5000}, True),  # too long to render, still a number
        ("big == 1", {"big": 10**5000}, False),
        ("x > 1", {"x": float("nan")}, False),
        ("x < 1", {"x": float("nan")}, False),
        ("x > 1", {"x": float("inf")}, False),
        ("x > 1", {"x": "9" * 65}, False),  # too long to read as a number
        ("x > 1", {"x": "9" * 64}, True),
        ("x > 1", {"x": " 9"}, False),
        ("x > 1", {"x": "٩"}, False),  # digits are ASCII
        ("8192 == 8192", {}, True),
        ("1 < 2", {}, True),
    ],
)
def test_numbers_and_strings(expression: str, view: dict[str, Any], expected: bool) -> None:
    assert selects(expression, view) is expected


def test_huge_number_literals_are_fine() -> None:
    digits = "9" * 900
    assert selects(f"x < {digits}", {"x": 10**50})
    assert not selects(f"x == {digits}", {"x": 1})
    assert "too large" in str(refusal(f"x < {digits}.5"))


# --------------------------------------------------------------------------- missing


@pytest.mark.parametrize("op", ["==", "!=", "<", "<=", ">", ">=", "~"])
@pytest.mark.parametrize("view", [{}, {"gpu": None}, {"gpu": {"name": "mali"}}])
def test_missing_null_or_object_fields_fail_every_comparison(
    op: str, view: dict[str, Any]
) -> None:
    assert not selects(f"gpu {op} 'mali'", view)
    assert not selects(f"gpu {op} ''", view)
    if op != "~":  # the right side of ~ is always a pattern
        assert not selects(f"'mali' {op} gpu", view)
        assert not selects(f"gpu {op} 0", view)


def test_not_equal_on_a_missing_field_is_false_but_negated_equality_is_true() -> None:
    assert not selects("gpu != 'mali'", PIXEL)
    assert selects("!(gpu == 'mali')", PIXEL)
    assert selects("!gpu", PIXEL)
    assert selects("!vram_mb", PIXEL)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        (False, False),
        (0, False),
        (0.0, False),
        ("", False),
        ([], False),
        ({"a": 1}, False),
        (True, True),
        (1, True),
        (-1, True),
        (0.5, True),
        ("0", True),
        ("false", True),
        (["x"], True),
    ],
)
def test_bare_field_is_a_presence_test(value: Any, expected: bool) -> None:
    assert selects("gpu", {"gpu": value}) is expected
    assert selects("!gpu", {"gpu": value}) is not expected


def test_bare_field_absent() -> None:
    assert not selects("gpu", {})
    assert selects("!gpu", {})


# --------------------------------------------------------------------------- lists


def test_pools_and_capabilities_read_as_comma_joined_strings() -> None:
    assert selects("pools == 'lab,android'", PIXEL)
    assert selects("capabilities == 'benchmark:jssha,self-check'", PIXEL)
    assert selects("capabilities ~ 'benchmark'", PIXEL)
    assert selects("capabilities ~ '(^|,)self-check(,|$)'", PIXEL)
    lab = compile_match("pools ~ '(^|,)lab(,|$)'")
    assert lab.evaluate(PIXEL)
    assert not lab.evaluate(IPHONE)  # "labs" is another pool
    assert not lab.evaluate(PI)


def test_capabilities_none_reads_as_missing_and_empty_list_as_empty() -> None:
    assert not selects("capabilities ~ ''", IPHONE)
    assert not selects("capabilities != 'benchmark'", IPHONE)
    assert selects("!capabilities", IPHONE)
    assert selects("capabilities == ''", PI)
    assert selects("capabilities != 'benchmark'", PI)
    assert selects("!capabilities && !pools", PI)


def test_list_elements_render_like_scalars() -> None:
    view = {"tags": [1, 2.0, True, None, "x", {"no": 1}, ["nested"]]}
    assert selects("tags == '1,2,true,x'", view)


# --------------------------------------------------------------------------- API


def test_fields_names_every_identifier() -> None:
    matcher = compile_match(
        "ram_mb >= 8192 && (platform == 'android' || !gpu) && capabilities ~ 'x' && true"
    )
    assert matcher.fields == frozenset({"ram_mb", "platform", "gpu", "capabilities"})
    assert compile_match("'a' == 'a'").fields == frozenset()
    assert compile_match("beacon.battery_pct > 20").fields == frozenset({"beacon.battery_pct"})


def test_dotted_and_extra_keys() -> None:
    assert selects("beacon.battery_pct > 20 && name ~ 'bench'", {
        "beacon.battery_pct": 55, "name": "Bench phone"
    })


def test_matcher_is_reusable_and_described() -> None:
    matcher = compile_match("kind == 'phone'")
    assert isinstance(matcher, Matcher)
    assert [matcher.evaluate(d) for d in (PIXEL, IPHONE, PI) * 3] == [True, True, False] * 3
    assert "kind == 'phone'" in repr(matcher)
    assert matcher.text == "kind == 'phone'"


def test_compiled_caches_by_text() -> None:
    first = compiled("platform == 'android' && ram_mb >= 4096")
    assert compiled("platform == 'android' && ram_mb >= 4096") is first
    assert compiled("platform == 'ios'") is not first
    with pytest.raises(MatchError):
        compiled("platform ==")
    assert compiled.cache_info().maxsize == 1024


def test_match_error_is_a_value_error() -> None:
    error = refusal("platform ==")
    assert isinstance(error, ValueError)
    assert error.position == 12


def test_not_a_string() -> None:
    with pytest.raises(MatchError):
        compile_match(42)  # type: ignore[arg-type]


def test_module_never_evaluates_text() -> None:
    source = inspect.getsource(match)
    assert re.search(r"(?<![.\w])(eval|exec|compile)\(", source) is None
    assert "aiohttp" not in source


# --------------------------------------------------------------------------- syntax errors


@pytest.mark.parametrize(
    ("expression", "position", "fragment"),
    [
        ("", 1, "empty"),
        ("   ", 1, "empty"),
        ("platform = 'android'", 10, "use '=='"),
        ("a & b", 3, "use '&&'"),
        ("a | b", 3, "use '||'"),
        ("ram_mb >=", 10, "after '>='"),
        ("ram_mb >= && a", 11, "after '>='"),
        ("a &&", 5, "end of the expression"),
        ("a || || b", 6, "'||'"),
        ("(platform == 'ios'", 19, "close '(' at position 1"),
        ("((a) || (b)", 12, "close '(' at position 1"),
        ("platform == 'ios')", 18, "unexpected ')'"),
        ("a b", 3, "unexpected 'b'"),
        ("soc ~ 'abc", 7, "not closed"),
        ("soc ~ 'abc\\'", 7, "not closed"),
        ('soc ~ "abc', 7, "not closed"),
        ("ram_mb > $", 10, "unexpected character '$'"),
        ("ram_mb > 8192 # note", 15, "unexpected character '#'"),
        ("ram_mb > 1.", 10, "malformed number '1.'"),
        ("ram_mb > 1.2.3", 10, "malformed number"),
        ("8192mb > 1", 1, "malformed number '8192mb'"),
        ("x > -", 5, "'-' at position 5 must begin a number"),
        ("x > - 1", 5, "must begin a number"),
        ("a < b < c", 7, "do not chain"),
        ("a == b != c", 8, "do not chain"),
        ("!platform == 'ios'", 11, "write !(a == b)"),
        ("(a) == 'x'", 5, "parenthesised group"),
        ("'android'", 1, "not a condition"),
        ("a && 42", 6, "not a condition"),
        ("!'x'", 2, "not a condition"),
        ("soc ~ model", 7, "must be a quoted pattern"),
        ("soc ~ 42", 7, "must be a quoted pattern"),
        ("a ==> b", 5, "'>' at position 5"),
        ("()", 2, "')'"),
        ("a ===  b", 5, "'=' at position 5"),
        ("é == 1", 1, "unexpected character 'é'"),
        ("a\x00", 2, "unexpected character"),
        ("a ~ 'b' ~ 'c'", 9, "do not chain"),
    ],
)
def test_syntax_errors_name_the_position(expression: str, position: int, fragment: str) -> None:
    error = refusal(expression)
    assert error.position == position, str(error)
    assert fragment in str(error)
    if expression.strip():
        assert f"position {position}" in str(error)


# --------------------------------------------------------------------------- limits


def test_expression_length_limit() -> None:
    longest = "a == '" + "x" * (match.MAX_EXPRESSION_CHARS - 7) + "'"
    assert len(longest) == match.MAX_EXPRESSION_CHARS
    assert compile_match(longest)
    error = refusal(longest + " ")
    assert "1001 characters" in str(error)


def test_nesting_limit_for_parentheses() -> None:
    depth = match.MAX_NESTING
    assert selects("(" * depth + "kind" + ")" * depth, PIXEL)
    error = refusal("(" * (depth + 1) + "kind" + ")" * (depth + 1))
    assert "deeper than 32" in str(error)
    assert error.position == depth + 1


def test_nesting_limit_for_negation() -> None:
    assert selects("!" * 32 + "kind", PIXEL)
    assert "deeper than 32" in str(refusal("!" * 33 + "kind"))
    assert "deeper than 32" in str(refusal("!(" * 17 + "kind" + ")" * 17))


def test_node_limit() -> None:
    fine = " || ".join(["a"] * 128)  # 128 operands and 127 operators
    assert compile_match(fine)
    error = refusal(" || ".join(["a"] * 129))
    assert "more than 256 parts" in str(error)


def test_deep_nesting_never_reaches_the_recursion_limit() -> None:
    for text in ("(" * 500, "!" * 500, "(!" * 300, "a ~ '" + "(" * 128 + "'"):
        refusal(text)
    deep_pattern = compile_match("a ~ '" + "(" * 127 + "a" + ")" * 127 + "'")
    assert deep_pattern.evaluate({"a": "a"})


# --------------------------------------------------------------------------- regex safety

REDOS_CORPUS = [
    # nested or ambiguous repetition: exponential
    ("(a+)+$", "nests repetition"),
    ("(a+)+b", "nests repetition"),
    ("(a*)*", "nests repetition"),
    ("(.*)*", "nests repetition"),
    ("(.*a){12}", "nests repetition"),
    (r"^(\w+\s?)*$", "nests repetition"),
    ("(x+x+)+y", "nests repetition"),
    ("([a-zA-Z]+)*$", "nests repetition"),
    (r"^(([a-z])+.)+[A-Z]([a-z])+$", "nests repetition"),
    (r"^([a-z0-9]+([-.][a-z0-9]+)*)*$", "nests repetition"),
    (r"(\d+)*\.", "nests repetition"),
    ("(a?){25}a{25}", "nests repetition"),
    ("(a?b?)+$", "nests repetition"),
    ("(a{2})+", "nests repetition"),
    ("(?:a+)+", "nests repetition"),
    ("(?>a+)+b", "nests repetition"),
    ("(a++)+b", "nests repetition"),
    ("(?=a+)+", "nests repetition"),
    (
        r"^([a-zA-Z0-9])(([\-.]|[_]+)?([a-zA-Z0-9]+))*(@){1}[a-z0-9]+[.]{1}"
        r"(([a-z]{2,3})|([a-z]{2,3}[.]{1}[a-z]{2,3}))$",
        "nests repetition",
    ),
    ("(a|aa)+", "repeats an alternation"),
    ("(a|a)*", "repeats an alternation"),
    ("(a|b)+", "repeats an alternation"),
    ("(?:a|b)+", "repeats an alternation"),
    ("(a|a?)+", "repeats an alternation"),
    (r"(\w|\d)+$", "repeats an alternation"),
    ("((ab|a)c)+", "repeats an alternation"),
    ("(a|b){2,}", "repeats an alternation"),
    ("(a|b){3}", "repeats an alternation"),
    ("(.|\n)*x", "repeats an alternation"),
    # polynomial: too many open-ended repeats
    (".*.*.*.*x", "more than 3 open-ended repeats"),
    ("a+b+c+d+$", "more than 3 open-ended repeats"),
    (r"\s*\d+\s*\w+\s*$", "more than 3 open-ended repeats"),
    ("x{0,11}y{0,11}z{0,11}w{0,11}v", "more than 3 open-ended repeats"),
    # within the count but still slow on 256 characters: the step estimate
    (".*.*.*x", "could take about"),
    (r"\d+\d+\d+$", "could take about"),
    (r"^\s*.*\s*$", "could take about"),
    ("(a|a)" * 16 + "b", "could take about"),
    ("(a|aa)" * 12 + "b", "could take about"),
    ("a?" * 30 + "a" * 30, "could take about"),
    (".{0,10}" * 6 + "x", "could take about"),
    ("(a|ab|abc|abcd)" * 8 + "x", "could take about"),
    # counts and lengths
    ("a{101}", "more than 100 times"),
    ("a{0,1000}", "more than 100 times"),
    ("a{500,}", "more than 100 times"),
    ("(.*){1,32000}[bc]", "more than 100 times"),
    ("x" * 257, "longer than 256 characters"),
    # features that are refused outright
    (r"(a)\1", "backreference"),
    ("(?P<x>a+)(?P=x)", "backreference"),
    (r"^(a+)\1+$", "backreference"),
    ("(a)?(?(1)b|c)", "conditional group"),
]


@pytest.mark.parametrize(("pattern", "reason"), REDOS_CORPUS)
def test_unsafe_patterns_are_refused(pattern: str, reason: str) -> None:
    quoted = "'" + pattern.replace("\\", "\\\\").replace("'", "\\'") + "'"
    error = refusal(f"model ~ {quoted}")
    assert reason in str(error)
    assert error.position == 9
    assert str(error).startswith("match pattern ")
    assert "at position 9" in str(error)


def test_refusal_sentence_shape() -> None:
    assert str(refusal("x ~ '(a+)+'")) == (
        "match pattern '(a+)+' at position 5 nests repetition, which can take exponential "
        "time; simplify it"
    )


SAFE_PATTERNS = [
    "benchmark",
    "benchmark:jssha",
    "snapdragon|tensor|exynos|dimensity|helio|kirin|apple",
    "(^|,)lab(,|$)",
    "^android 1[3-5]",
    "pixel [6-9]( pro)?",
    r"\d+\.\d+",
    r"^\d+\.\d+$",
    "^(?:arm64|aarch64)$",
    "colou?r",
    "[a-z]+",
    "lab.*gpu.*",
    "^.*lab.*gpu",
    "a.*b",
    "(foo|bar).*(baz|qux)",
    r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}",
    "^(?=.*a)(?=.*b)",
    "(a|b)?c",
    "([ab])+",
    "(ab)+c",
    "(?:ab){3}",
    "[(|)]+",
    r"\(a\|b\)+",
    "a{100}",
    "x" * 256,
    "(?i)MiXeD",
    "",
]


@pytest.mark.parametrize("pattern", SAFE_PATTERNS)
def test_ordinary_patterns_are_accepted(pattern: str) -> None:
    quoted = "'" + pattern.replace("\\", "\\\\") + "'"
    compile_match(f"model ~ {quoted}")


def test_anchoring_brings_a_pattern_under_the_estimate() -> None:
    assert "anchor it with ^" in str(refusal("x ~ '.*a.*b'"))
    assert selects("x ~ '^.*a.*b'", {"x": "zzazzb"})


def test_estimate_is_summed_over_the_expression() -> None:
    one = r"x ~ '\d+\.\d+'"
    compile_match(" || ".join([one] * 7))
    error = refusal(" || ".join([one] * 8))
    assert "patterns of this match expression" in str(error)


def test_invalid_patterns_carry_re_message() -> None:
    error = refusal("soc ~ '['")
    assert "not a valid regular expression: unterminated character set" in str(error)
    assert error.position == 7
    assert "not a valid regular expression" in str(refusal("soc ~ 'a{99999999999999999999}'"))
    assert "not a valid regular expression" in str(refusal("soc ~ '(?<'"))


def test_patterns_ignore_case() -> None:
    assert selects("soc ~ 'TENSOR'", PIXEL)
    assert selects("soc ~ '[t]ensor g[0-9]'", PIXEL)


# --------------------------------------------------------------------------- properties

EXPRESSION_ALPHABET = list("abgpu_.09 -()!=<>~&|'\"\\*+?[]{}^$,")
FIELDS = ["a", "b", "gpu", "ram_mb", "pools", "capabilities", "platform"]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=300)
    | st.sampled_from(["8192", "-1.5", "android", "lab,gpu", "9" * 80])
    | st.integers(4300, 5000).map(lambda n: 10**n)  # too long for str()
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
views = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), json_values, max_size=8)

operands = st.sampled_from(FIELDS) | st.sampled_from(
    ["'android'", '"lab"', "8192", "-1.5", "0", "true", "false", "''", "'8192'"]
)
patterns = st.sampled_from(["'a'", "'^a|b$'", "'(^|,)lab(,|$)'", "'[0-9]+'", "''", "'.*'"])
comparisons = (
    st.tuples(
        st.sampled_from(FIELDS),
        st.sampled_from(["==", "!=", "<", "<=", ">", ">="]),
        operands,
    ).map(" ".join)
    | st.tuples(st.sampled_from(FIELDS), patterns).map(lambda t: f"{t[0]} ~ {t[1]}")
    | st.sampled_from(FIELDS)
)
expressions = st.recursive(
    comparisons,
    lambda inner: (
        st.tuples(inner, st.sampled_from([" && ", " || "]), inner).map("".join)
        | inner.map(lambda e: f"!({e})")
        | inner.map(lambda e: f"({e})")
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=200) | st.text(alphabet=EXPRESSION_ALPHABET, max_size=120))
def test_random_text_raises_only_match_error(text: str) -> None:
    try:
        matcher = compile_match(text)
    except MatchError as error:
        assert str(error)
        assert error.position is None or 1 <= error.position <= len(text) + 1
    else:
        assert isinstance(matcher.evaluate({}), bool)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=list("ab.*+?|()[]{}^$\\0123,"), max_size=40))
def test_random_patterns_raise_only_match_error(pattern: str) -> None:
    quoted = "'" + pattern.replace("\\", "\\\\").replace("'", "\\'") + "'"
    try:
        matcher = compile_match(f"a ~ {quoted}")
    except MatchError as error:
        assert str(error).startswith("match pattern ")
    else:
        assert isinstance(matcher.evaluate({"a": "ab" * 200}), bool)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expressions, views)
def test_evaluate_never_raises_and_negation_agrees(expression: str, view: dict[str, Any]) -> None:
    matcher = compile_match(expression)
    result = matcher.evaluate(view)
    assert isinstance(result, bool)
    assert compile_match(f"!({expression})").evaluate(view) is (not result)
    assert matcher.fields <= set(FIELDS)


@settings(max_examples=200, deadline=None)
@given(expressions, expressions, views)
def test_and_or_agree_with_python(left: str, right: str, view: dict[str, Any]) -> None:
    a = compile_match(left).evaluate(view)
    b = compile_match(right).evaluate(view)
    assert compile_match(f"({left}) && ({right})").evaluate(view) is (a and b)
    assert compile_match(f"({left}) || ({right})").evaluate(view) is (a or b)
