"""The hand-written validators (fleet_min/validate.py) against the JSON Schemas they follow.

Every document of the hand-written corpus (tests/validation_corpus/*.json) and every document
hypothesis derives from it goes through both the hand-written validator and jsonschema's
Draft202012Validator; a test fails whenever the two disagree on valid/invalid, or when a rule's
quick answer (`ok`) and its sentences disagree. The corpus also
pins the sentences (each names the field) and, by field_paths(), that every field of every schema
has at least one invalid case.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from fleet_min import validate as v

HERE = pathlib.Path(__file__).parent
CORPUS_DIR = HERE / "validation_corpus"
SCHEMA_DIR = HERE.parent / "fleet_min" / "schemas"

VALIDATORS: dict[str, Callable[[object], list[str]]] = {
    "job": v.validate_job,
    "result": v.validate_result,
    "beacon": v.validate_beacon,
    "register": v.validate_register,
}
SCHEMAS = {name: json.loads((SCHEMA_DIR / f"{name}.json").read_text()) for name in VALIDATORS}
CHECKERS = {name: Draft202012Validator(schema) for name, schema in SCHEMAS.items()}


# --------------------------------------------------------------------------------------------
# The corpus: base documents changed by "set"/"unset", with $repeat/$copies/$range macros.

def _expand(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$repeat"}:
            text, n = value["$repeat"]
            return text * n
        if set(value) == {"$copies"}:
            item, n = value["$copies"]
            return [copy.deepcopy(item) for _ in range(n)]
        if set(value) == {"$range"}:
            prefix, n = value["$range"]
            return [f"{prefix}{i}" for i in range(n)]
        return {k: _expand(x) for k, x in value.items()}
    if isinstance(value, list):
        return [_expand(x) for x in value]
    return value


def _container(doc: Any, parts: list[str]) -> Any:
    node = doc
    for part in parts:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    return node


def _apply(base: Any, case: dict[str, Any]) -> Any:
    if "doc" in case:
        return _expand(case["doc"])
    doc = copy.deepcopy(base)
    for path, value in case.get("set", {}).items():
        *parents, last = path.split("/")
        node = _container(doc, parents)
        node[int(last) if isinstance(node, list) else last] = _expand(value)
    for path in case.get("unset", []):
        *parents, last = path.split("/")
        del _container(doc, parents)[last]
    return doc


def load_corpus(name: str) -> list[tuple[str, Any, bool, str | None]]:
    data = json.loads((CORPUS_DIR / f"{name}.json").read_text())
    return [(case["why"], _apply(data["base"], case), case["valid"], case.get("error"))
            for case in data["cases"]]


CORPUS = {name: load_corpus(name) for name in VALIDATORS}
CORPUS_PARAMS = [pytest.param(name, doc, valid, error, id=f"{name}: {why}")
                 for name, cases in CORPUS.items() for why, doc, valid, error in cases]


# The whole-document rule behind each validator, asked both ways in assert_agree.
RULES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "job": v._job_rule,
    "result": lambda doc: v._RESULT,
    "beacon": lambda doc: v._BEACON,
    "register": lambda doc: v._REGISTER,
}


def assert_agree(name: str, doc: object) -> list[str]:
    messages = VALIDATORS[name](doc)
    if isinstance(doc, dict):
        # The quick answer (ok) and the sentences must agree: the validators trust ok alone
        # for a document it accepts.
        rule = RULES[name](doc)
        assert rule.ok(doc) == (rule(doc, "") == []), (
            f"{name}: ok() says {rule.ok(doc)} but the sentences are {rule(doc, '')[:3]} for "
            f"{json.dumps(doc, default=repr)[:1500]}")
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # jsonschema puts repr(instance) in its messages
    try:
        schema_errors = [e.message[:200] for e in CHECKERS[name].iter_errors(doc)]
    finally:
        sys.set_int_max_str_digits(limit)
    assert (not messages) == (not schema_errors), (
        f"validate_{name} and {name}.json disagree on {json.dumps(doc, default=repr)[:1500]}\n"
        f"  validate_{name}: {messages}\n  jsonschema: {schema_errors[:5]}")
    return messages


# --------------------------------------------------------------------------------------------
# The schema files themselves.

@pytest.mark.parametrize("name", list(VALIDATORS))
def test_schema_file_is_valid_draft_2020_12(name: str) -> None:
    schema = SCHEMAS[name]
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert v.load_schema(name) == schema


def test_shared_definitions_are_identical_in_every_file() -> None:
    job_id = SCHEMAS["job"]["$defs"]["jobId"]
    for name in VALIDATORS:
        assert SCHEMAS[name]["$defs"]["jobId"] == job_id, name
    assert SCHEMAS["result"]["$defs"]["sha256"] == SCHEMAS["job"]["$defs"]["sha256"]


def test_load_schema_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match="no schema named"):
        v.load_schema("../pyproject")


def test_validate_module_uses_the_standard_library_only() -> None:
    tree = ast.parse((HERE.parent / "fleet_min" / "validate.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


# --------------------------------------------------------------------------------------------
# The hand-written corpus.

@pytest.mark.parametrize(("name", "doc", "valid", "error"), CORPUS_PARAMS)
def test_corpus_case(name: str, doc: Any, valid: bool, error: str | None) -> None:
    before = copy.deepcopy(doc)
    assert CHECKERS[name].is_valid(doc) == valid, "the corpus expectation disagrees with the schema"
    messages = assert_agree(name, doc)
    assert doc == before, "a validator changed its input"
    if not valid:
        assert error, "an invalid case names the sentence it expects"
        assert any(error in m for m in messages), messages


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_corpus_is_large_and_mixed(name: str) -> None:
    verdicts = [valid for _why, _doc, valid, _error in CORPUS[name]]
    assert len(verdicts) >= 40
    assert verdicts.count(True) >= 8 and verdicts.count(False) >= 25


def field_paths(schema: dict[str, Any], node: dict[str, Any] | None = None,
                prefix: str = "") -> Iterator[str]:
    """Dotted paths of every declared property, through $ref, allOf/anyOf and if/then."""
    node = schema if node is None else node
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        yield path
        yield from field_paths(schema, sub, path)
    then = [node["then"]] if "then" in node else []
    for sub in [*node.get("allOf", []), *node.get("anyOf", []), *then]:
        yield from field_paths(schema, sub, prefix)


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_field_has_an_invalid_case_that_names_it(name: str) -> None:
    named = set()
    for _why, doc, valid, _error in CORPUS[name]:
        if not valid:
            named |= {re.split(r"[ \[]", m, maxsplit=1)[0] for m in VALIDATORS[name](doc)}
    missing = sorted(set(field_paths(SCHEMAS[name])) - named)
    assert not missing, f"no invalid corpus case names {missing}"


def test_post_results_dispatches_on_kind() -> None:
    for name in ("result", "beacon"):
        for _why, doc, _valid, _error in CORPUS[name]:
            either = CHECKERS["result"].is_valid(doc) or CHECKERS["beacon"].is_valid(doc)
            assert (not v.validate_post_results(doc)) == either
    assert v.validate_post_results([]) == ["the body must be a JSON object"]
    assert v.validate_post_results({"schema": 1}) == ['kind is required: "result" or "beacon"']
    assert v.validate_post_results({"kind": ["result"]}) == ['kind must be "result" or "beacon"']
    assert "device_id is required" in v.validate_post_results({"schema": 1, "kind": "beacon"})


# --------------------------------------------------------------------------------------------
# Generated documents: valid corpus documents mutated, checked by both sides.

SEEDS = {name: [doc for _why, doc, valid, _error in cases if valid]
         for name, cases in CORPUS.items()}
HEX = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
REFS = ["${jobs.a.metrics.n}", "${jobs.a.artifact}"]
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "maxItems")


def _bounds_by_key(schema: dict[str, Any]) -> dict[str, set[Any]]:
    """Each property name with the numeric bounds and lengths found anywhere under it."""
    bounds: dict[str, set[Any]] = {}
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        key, node = stack.pop()
        if not isinstance(node, dict):
            continue
        if "$ref" in node:
            stack.append((key, schema["$defs"][node["$ref"].rsplit("/", 1)[1]]))
        bounds.setdefault(key, set()).update(node[k] for k in BOUND_KEYWORDS if k in node)
        stack += list(node.get("properties", {}).items())
        stack += list(node.get("patternProperties", {}).items())
        stack += [(key, sub) for sub in [*node.get("allOf", []), *node.get("anyOf", [])]]
        stack += [(key, node[k]) for k in ("items", "then") if k in node]
    return bounds


BOUNDS = {name: _bounds_by_key(schema) for name, schema in SCHEMAS.items()}
KEYS = {name: sorted(k for k in bounds if k) for name, bounds in BOUNDS.items()}


def _near_bounds(bounds: set[Any]) -> list[Any]:
    """Values on and just across each bound: numbers, strings and arrays of that size."""
    near: list[Any] = []
    for b in sorted(bounds):
        near += [b - 1, b, b + 1, b - 0.5, b + 0.5, float(b), -b]
        if 0 < b <= 5000:
            near += ["a" * (b - 1), "a" * b, "a" * (b + 1), ["a" * b], ["a" * (b + 1)]]
        if 0 < b <= 300:
            near += [[f"x{i}" for i in range(n)] for n in (b - 1, b, b + 1)]
            near += [[HEX] * (b + 1)]
    return near


TYPE_SAMPLES: list[Any] = [None, True, False, 0, -1, 1, 1.0, 2.5, "", "a", [], {}, [1], ["a"],
                           {"a": 1}, HEX, *REFS]


def _neighbours(value: Any) -> list[Any]:
    """Small changes to a value that tend to cross a rule: types, edges, case, lengths."""
    if isinstance(value, bool):
        return [not value, int(value), str(value).lower(), None]
    if isinstance(value, int | float):
        return [value - 1, value + 1, -value, value + 0.5, float(value), -value - 1,
                value * 1000, str(value), True, *REFS]
    if isinstance(value, str):
        return ["-" + value, value + "\n", value.upper(), value[:-1], value + "a", value + "/",
                " " + value, value + value, "", "\u00e9" + value[1:], value + "-", *REFS,
                value + " " + REFS[0], value.replace("a", "A")]
    if isinstance(value, list):
        return [[], value + value[:1], value[1:], value[:1] * 2, REFS[:1], REFS[0], [value],
                [None, *value]]
    if isinstance(value, dict):
        return [{}, [value], REFS[0], None]
    return [None]


INTERESTING_STRINGS = [
    "", " ", "a", "-a", "a-", "a/b", "a b", "a\n", "\n", "a\u0000b", "caf\u00e9", "\ud800",
    "1", "true", "null", "latest", "Latest", "device", "host", "result", "beacon", "cold", "warm",
    "hot", "tepid", "flow_runner", "native_bundle", "benchmark", "batch", "serve", "cold-start",
    "web-test", "web-shots", "soak", "app-soak", "a11y-audit", "vantage", "custom",
    HEX, HEX.upper(), HEX[:-1], HEX + "0", HEX + "\n",
    "${jobs.a.artifact}", "${jobs.a.metrics.n}", "${jobs.a.b.metrics.c.d}",
    "${jobs.a.artifact}\n", "x ${jobs.a.artifact}", "${jobs.-a.artifact}", "${jobs.a.metrics.}",
    "${jobs..artifact}", "${jobs.a/b.artifact}", "${jobs.a.artifacts}", "$" + "{jobs.a.artifact",
    "o/r@abcdef1", "o/r@ABCDEF1", "o/r@abcdef", "o/r@" + "a" * 41, "o/r@abcdef1\n", "or@abcdef1",
]


def values_for(name: str) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.sampled_from(TYPE_SAMPLES),
        st.integers(), st.floats(allow_nan=False),
        st.sampled_from(INTERESTING_STRINGS),
        st.text(max_size=12),
    )
    return st.one_of(
        scalars,
        st.lists(scalars, max_size=4),
        st.dictionaries(st.sampled_from(KEYS[name]), scalars, max_size=3),
    )


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key or index) of every value inside doc."""
    slots = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            slots.append((node, key))
            if isinstance(value, dict | list):
                stack.append(value)
    return slots


OPS = ["neighbour"] * 4 + ["bound"] * 3 + ["type"] * 2 + ["delete"] * 2 + ["add", "random"]


def _mutation(draw: st.DrawFn, name: str, key: Any, value: Any, op: str) -> Any:
    # A copy, so that later changes never reach the shared samples (hypothesis needs the same
    # draws to give the same documents).
    return copy.deepcopy(_pick(draw, name, key, value, op))


def _pick(draw: st.DrawFn, name: str, key: Any, value: Any, op: str) -> Any:
    near = _near_bounds(BOUNDS[name].get(key, set())) if isinstance(key, str) else []
    if op == "bound" and near:
        return draw(st.sampled_from(near))
    if op == "type":
        return draw(st.sampled_from(TYPE_SAMPLES))
    if op == "random":
        return draw(values_for(name))
    return draw(st.sampled_from(_neighbours(value)))


@st.composite
def mutated(draw: st.DrawFn, name: str) -> Any:
    """A valid corpus document with one to three changes, most of them small."""
    doc = copy.deepcopy(draw(st.sampled_from(SEEDS[name])))
    for _ in range(draw(st.sampled_from([1, 1, 1, 1, 2, 3]))):
        slots = _slots(doc)
        op = draw(st.sampled_from(OPS))
        if op == "add" or not slots:
            containers = [doc, *(c[k] for c, k in slots if isinstance(c[k], dict))]
            target = draw(st.sampled_from(containers))
            key = draw(st.one_of(st.sampled_from(KEYS[name]), st.text(max_size=8)))
            target[key] = _mutation(draw, name, key, None, draw(st.sampled_from(OPS[4:])))
            continue
        container, key = draw(st.sampled_from(slots))
        if op == "delete":
            del container[key]
        else:
            container[key] = _mutation(draw, name, key, container[key], op)
    return doc


def _paths(doc: Any) -> list[tuple[Any, ...]]:
    """Paths (tuples of keys and indices) of the values inside doc; of long arrays only the ends."""
    paths: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), doc)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            children = list(node.items())
        elif isinstance(node, list):
            children = [(i, x) for i, x in enumerate(node) if i in (0, len(node) - 1)]
        else:
            continue
        for key, value in children:
            paths.append((*path, key))
            stack.append(((*path, key), value))
    return paths


def _sweep(name: str) -> Iterator[Any]:
    """Every single change of every valid corpus document: each value deleted, swapped for each
    type, nudged, and pushed onto and across each bound of its field; each known key added."""
    seen = set()
    for seed in SEEDS[name]:
        for path in _paths(seed):
            # Only params are typed per workload; elsewhere one context is enough.
            context = seed.get("workload") if path[0] == "params" else None
            signature = (context, tuple(p if isinstance(p, str) else "#" for p in path))
            if signature in seen:
                continue
            seen.add(signature)
            *parents, last = path
            value = _container(seed, [str(p) for p in parents])
            value = value[last]
            key = last if isinstance(last, str) else (parents[-1] if parents else "")
            near = _near_bounds(BOUNDS[name].get(key, set()))
            changes = [*TYPE_SAMPLES, *_neighbours(value), *near]
            for change in [_DELETE, *changes]:
                doc = copy.deepcopy(seed)
                container = _container(doc, [str(p) for p in parents])
                if change is _DELETE:
                    del container[last]
                else:
                    container[last] = copy.deepcopy(change)
                yield doc
    base = SEEDS[name][0]
    objects = [p for p in _paths(base) if isinstance(_container(base, [str(x) for x in p]), dict)]
    for path in [(), *objects]:
        for key in KEYS[name]:
            for value in (None, "a", -1, 1.5, {}):
                doc = copy.deepcopy(base)
                _container(doc, [str(p) for p in path])[key] = value
                yield doc


_DELETE = object()


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_single_change_of_the_corpus_is_judged_alike(name: str) -> None:
    count = 0
    for doc in _sweep(name):
        count += 1
        if (not VALIDATORS[name](doc)) != CHECKERS[name].is_valid(doc):
            assert_agree(name, doc)
    assert count > 500


# FLEET_VALIDATE_EXAMPLES=5000 runs a longer search. database=None: no .hypothesis/ directory
# in the checkout; a failure prints the document that disagrees.
EXAMPLES = int(os.environ.get("FLEET_VALIDATE_EXAMPLES", "250"))
GENERATED = settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))


@GENERATED
@given(doc=mutated("job"))
def test_generated_jobs_agree(doc: Any) -> None:
    assert_agree("job", doc)


@GENERATED
@given(doc=mutated("result"))
def test_generated_results_agree(doc: Any) -> None:
    assert_agree("result", doc)


@GENERATED
@given(doc=mutated("beacon"))
def test_generated_beacons_agree(doc: Any) -> None:
    assert_agree("beacon", doc)
    both = CHECKERS["result"].is_valid(doc) or CHECKERS["beacon"].is_valid(doc)
    assert (not v.validate_post_results(doc)) == both


@GENERATED
@given(doc=mutated("register"))
def test_generated_registrations_agree(doc: Any) -> None:
    assert_agree("register", doc)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=10)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=4),
    max_leaves=20,
)


@settings(max_examples=max(150, EXAMPLES // 2), deadline=None, database=None)
@given(doc=JSON_VALUES, name=st.sampled_from(list(VALIDATORS)))
def test_any_json_value_is_judged_alike(doc: Any, name: str) -> None:
    assert_agree(name, doc)


# --------------------------------------------------------------------------------------------
# Sentences.

PATH_START = re.compile(r"(the |further problems|[A-Za-z_][A-Za-z0-9_.\[\]-]* (must|is|has) )")


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_sentence_starts_with_the_field_it_is_about(name: str) -> None:
    for _why, doc, _valid, _error in CORPUS[name]:
        for message in VALIDATORS[name](doc):
            assert PATH_START.match(message), message
            assert "\n" not in message and len(message) < 400, message


def test_sentences_for_the_documented_examples() -> None:
    base = copy.deepcopy(SEEDS["job"][0])
    assert v.validate_job({**base, "lease": {"ttl_s": 0}}) == [
        "lease.ttl_s must be an integer from 1 to 86400"]
    assert v.validate_job({**base, "constraints": {"window": {"from": 24, "to": 1}}}) == [
        "constraints.window.from must be an integer from 0 to 23"]
    missing = dict(base)
    del missing["job_id"]
    assert v.validate_job(missing) == ["job_id is required"]


def test_values_are_never_echoed() -> None:
    doc = {"schema": 1, "job_id": "a", "workload": "batch", "executor": "device",
           "params": {"max_items": "hunter2-secret"}, "priority": 10**5000}
    messages = v.validate_job(doc)
    assert len(messages) == 2
    assert not any("hunter2" in m or "0000" in m for m in messages)


def test_many_problems_are_cut_short() -> None:
    doc = {"device_id": "d", "pools": list(range(500)), "capabilities": [None] * 500}
    messages = v.validate_register(doc)
    assert len(messages) == v.MAX_ERRORS + 1
    assert messages[-1] == "further problems are not listed"
    assert not CHECKERS["register"].is_valid(doc)


# --------------------------------------------------------------------------------------------
# Nothing crashes or stalls, whatever the input.

def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value, "password": 1}
    return value


def test_deep_nesting_neither_crashes_nor_recurses() -> None:
    deep = _nested(50_000, "${jobs.a.artifact}")
    job = {"schema": 1, "job_id": "a", "workload": "vantage", "executor": "device",
           "params": {"urls": [deep], "x": deep}, "depends_on": ["a"]}
    assert v.validate_job(job) == ["params.urls[0] must be a string"]
    assert v.find_template_refs(job) == [("a", "artifact", None)]
    assert len(v.find_secret_keys(job)) == 50_000
    assert v.validate_result({"schema": 1, "kind": "result", "device_id": "d", "job_id": "j",
                              "iter": 0, "metrics": {"thermal": deep}}) == []


@pytest.mark.parametrize("number", [10**5000, -(10**5000), float("inf"), float("-inf"),
                                    float("nan"), 2**63, 1e-300],
                         ids=["10**5000", "-10**5000", "inf", "-inf", "nan", "2**63", "1e-300"])
def test_extreme_numbers_are_judged_like_jsonschema(number: float) -> None:
    base = SEEDS["job"][0]
    for path in ("priority", "lease/ttl_s", "constraints/max_load", "params/prompt_tokens"):
        doc = copy.deepcopy(base)
        *parents, last = path.split("/")
        _container(doc, parents)[last] = number
        assert_agree("job", doc)
    for name, field in (("result", "iter"), ("register", "ttl_s"), ("beacon", "schema")):
        doc = copy.deepcopy(SEEDS[name][0])
        doc[field] = number
        assert_agree(name, doc)


def test_huge_and_odd_strings_are_fast() -> None:
    huge = "${jobs." + "a" * 1_000_000
    started = time.perf_counter()
    for text in (huge, "a" * 1_000_000 + "\n", "\u0000" * 100_000, "${jobs.a.artifact}" * 50_000):
        doc = {"schema": 1, "job_id": text, "workload": text, "executor": text,
               "params": {"max_items": text, "resume_from": text}, "targets": {"match": text},
               "app": {"sha256": text}, "report_to": {"ci_status": text}, text: text}
        assert v.validate_job(doc)
        assert_agree("job", doc)
        v.find_template_refs(doc)
        v.find_secret_keys(doc)
    assert time.perf_counter() - started < 5


def test_unhashable_and_foreign_values_do_not_crash() -> None:
    assert v.validate_job({"schema": 1, "job_id": "a", "workload": {"x": 1}, "executor": "host",
                           "params": {"port": []}})
    assert v.validate_job({"schema": 1, "job_id": "a", "workload": ["serve"], "executor": "host",
                           "lease": {1: 2, None: 3}})
    assert v.validate_job({"schema": 1, "job_id": "a", "workload": "x", "executor": "host",
                           "depends_on": [["a"], {"b": 1}, "a", "a"]})
    assert v.validate_beacon({"schema": 1, "kind": "beacon", "device_id": "d",
                              "beacon": {"busy": {"job_id": ("t",), "collector": b"x"}}})
    for value in (None, True, 0, 1.5, "x", [], (), b"x", object()):
        for validate in (*VALIDATORS.values(), v.validate_post_results):
            assert validate(value)
        assert v.find_template_refs(value) == []
        assert v.find_secret_keys(value) == []


# --------------------------------------------------------------------------------------------
# Template references.

@pytest.mark.parametrize(("text", "expected"), [
    ("${jobs.a.artifact}", ("a", None)),
    ("${jobs.a.metrics.n}", ("a", "n")),
    ("${jobs.build.v2.artifact}", ("build.v2", None)),
    ("${jobs.a.b.metrics.c}", ("a.b", "c")),
    ("${jobs.a.metrics.p50.ms}", ("a", "p50.ms")),
    ("${jobs.a.metrics.artifact}", ("a", "artifact")),
    ("${jobs.j:1@x_y-z.metrics.top1_pct}", ("j:1@x_y-z", "top1_pct")),
    ("${jobs.a.artifact}\n", None),
    ("x${jobs.a.artifact}", None),
    ("${jobs.a.artifact} ", None),
    ("${jobs.-a.artifact}", None),
    ("${jobs.a/b.artifact}", None),
    ("${jobs.a.metrics.}", None),
    ("${jobs.a.metrics}", None),
    ("${jobs.a.artifacts}", None),
    ("${job.a.artifact}", None),
    ("${jobs." + "a" * 200 + ".artifact}", ("a" * 200, None)),
    ("${jobs." + "a" * 201 + ".artifact}", None),
    ("${jobs.a.metrics." + "k" * 200 + "}", ("a", "k" * 200)),
    ("${jobs.a.metrics." + "k" * 201 + "}", None),
    ("${jobs.a.metrics.x:y}", None),
    ("${jobs.a.metrics.x y}", None),
    ("${jobs.a.metrics.x}}", None),
    ("${jobs.a.b}", None),
])
def test_template_ref_is_a_whole_string(text: str, expected: tuple[str, str | None] | None
                                        ) -> None:
    m = v.TEMPLATE_REF.match(text)
    assert (m.group("job_id"), m.group("key")) == expected if m else expected is None
    pattern = SCHEMAS["job"]["$defs"]["templateRef"]["pattern"]
    assert (re.search(pattern, text) is not None) == (expected is not None)


REF_PARTS = st.lists(st.sampled_from(["${", "jobs", ".", "a", "B", "9", "-", "_", ":", "@", "/",
                                      " ", "artifact", "metrics", "}", "\n", "$", "{"]),
                     max_size=14).map("".join)


REF_CHARS = "aZ09._:@-/ ${}\n\u00e9"
SHAPED_REFS = st.builds(
    lambda job, tail: "${jobs." + job + "." + tail + "}",
    st.text(REF_CHARS, min_size=0, max_size=4) | st.sampled_from(["a" * 200, "a" * 201]),
    st.sampled_from(["artifact", "artifacts", "metrics"])
    | st.text(REF_CHARS, max_size=4).map(lambda key: "metrics." + key)
    | st.sampled_from(["k" * 200, "k" * 201]).map(lambda key: "metrics." + key),
)


@settings(max_examples=max(300, EXAMPLES), deadline=None, database=None)
@given(text=st.one_of(REF_PARTS, REF_PARTS.map(lambda s: "${jobs." + s),
                      REF_PARTS.map(lambda s: "${jobs.a" + s + "}"), SHAPED_REFS))
def test_template_ref_agrees_with_the_schema_pattern(text: str) -> None:
    pattern = SCHEMAS["job"]["$defs"]["templateRef"]["pattern"]
    assert (v.TEMPLATE_REF.match(text) is not None) == (re.search(pattern, text) is not None)


def test_template_ref_stands_for_any_typed_value_in_params_app_model_suite() -> None:
    ref = "${jobs.a.metrics.n}"
    job = {"schema": 1, "job_id": "b", "workload": "serve", "executor": "device",
           "depends_on": ["a"], "params": {"port": ref, "resume_from": ref},
           "app": {"sha256": ref}, "model": {"sha256": ref}, "suite": {"kind": ref}}
    assert assert_agree("job", job) == []
    for field in ("priority", "lease"):
        assert assert_agree("job", {**job, field: ref}), f"{field} takes no references"
    assert assert_agree("job", {**job, "params": {"port": "port " + ref}}) == [
        "params.port must be an integer from 1 to 65535 or a template reference "
        "(${jobs.<id>.artifact} or ${jobs.<id>.metrics.<key>})"]


def test_find_template_refs_scans_every_string() -> None:
    job = {"schema": 1, "job_id": "c", "workload": "batch", "executor": "device",
           "depends_on": ["a", "b"],
           "params": {"max_items": "${jobs.a.metrics.n}",
                      "prompt": "use ${jobs.a.artifact} and ${jobs.b.metrics.p95_ms} now",
                      "list": [{"deep": ["${jobs.b.artifact}"]}, "${jobs.a.metrics.n}"],
                      "${jobs.key.artifact}": "keys are not scanned"},
           "app": {"sha256": "${jobs.b.artifact}"}}
    assert v.find_template_refs(job) == [
        ("a", "metrics", "n"), ("a", "artifact", None), ("b", "metrics", "p95_ms"),
        ("b", "artifact", None)]
    assert v.find_template_refs("${jobs.x.artifact}") == [("x", "artifact", None)]
    assert v.find_template_refs({"a": "no ${refs} here ${jobs.} $jobs.a.artifact"}) == []


# --------------------------------------------------------------------------------------------
# Secret-looking keys.

SECRET_KEYS = ["password", "passwd", "secret", "token", "api_key", "apikey", "apiKey", "APIKey",
               "API_KEY", "x-api-key", "access_key", "accessKey", "private_key", "privateKey",
               "client_secret", "clientSecret", "auth_token", "AUTH_TOKEN", "authToken",
               "bearer", "Bearer", "credential_value", "db.password", "github-token",
               "OAuthToken", "secrets", "passphrase", "private_key_path", "api_keys",
               "refresh_token", "sessionToken"]
INNOCENT_KEYS = ["prompt_tokens", "gen_tokens", "max_tokens", "promptTokens", "maxTokens",
                 "tokenizer", "secretary", "password_name", "secret_ref", "token_id", "tokenId",
                 "api_key_item", "apiKeyName", "credential", "account", "keyboard", "key",
                 "access", "private", "monkey", "turnkey", "", "_", "123", "passwordless",
                 "compassword", "api", "keys"]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_secret_keys_are_found(key: str) -> None:
    assert v.find_secret_keys({"params": {key: "x"}}) == [f"params.{key}"]


@pytest.mark.parametrize("key", INNOCENT_KEYS)
def test_innocent_keys_are_not_secrets(key: str) -> None:
    assert v.find_secret_keys({"params": {key: "x"}}) == []


def test_secret_keys_are_found_anywhere_with_their_paths() -> None:
    job = {"schema": 1, "job_id": "a", "workload": "archive", "executor": "host",
           "params": {"account": "store-upload", "max_tokens": 5,
                      "env": [{"name": "X"}, {"GITHUB_TOKEN": "ghp_x", "token_name": "gh"}]},
           "app": {"apiKey": None}, "password": "hunter2",
           "targets": {"match": "token ~ 'x'"}}
    assert v.find_secret_keys(job) == ["params.env[1].GITHUB_TOKEN", "app.apiKey", "password"]
    assert v.find_secret_keys(SEEDS["job"][0]) == []
    for _why, doc, _valid, _error in CORPUS["job"]:
        assert v.find_secret_keys(doc) == []


# Keys and strings a spec may hold: secret-like keys, innocent ones, template references.
SCAN_KEYS = st.sampled_from(["password", "apiKey", "token_name", "max_tokens", "env", "a", ""])
SCAN_STRINGS = st.sampled_from(["${jobs.a.artifact}", "x ${jobs.b.metrics.k} y", "${", "$",
                                "plain", ""])
SCAN_VALUES = st.recursive(
    st.none() | st.integers() | SCAN_STRINGS | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(SCAN_KEYS, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=max(200, EXAMPLES), deadline=None, database=None)
@given(doc=SCAN_VALUES)
def test_one_walk_scan_agrees_with_the_finer_searches(doc: Any) -> None:
    # check_spec skips find_secret_keys and find_template_refs on what the scan says is clean.
    secret_key, templated = v.scan_keys_and_strings(doc)
    assert secret_key == bool(v.find_secret_keys(doc))
    if not templated:
        assert v.find_template_refs(doc) == []


def test_one_walk_scan_sees_templates_anywhere() -> None:
    assert v.scan_keys_and_strings({"a": [{"b": ["x", "${jobs.j.artifact}"]}]}) == (False, True)
    assert v.scan_keys_and_strings("${jobs.j.artifact}") == (False, True)
    assert v.scan_keys_and_strings({"a": [1, "plain", {"b": None}]}) == (False, False)
    assert v.scan_keys_and_strings({"env": {"API_KEY": "x"}})[0] is True


def test_deep_secret_paths_keep_both_ends() -> None:
    for depth in range(1, 40):
        doc: Any = {"api_key": 1}
        steps = []
        for i in range(depth):
            doc = {f"k{i}": doc} if i % 2 else [doc]
            steps.append(f".k{i}" if i % 2 else "[0]")
        full = "".join(reversed(steps)).removeprefix(".") + ".api_key"
        [path] = v.find_secret_keys(doc)
        if depth + 1 <= 16:
            assert path == full
        else:
            head, tail = path.split(".(...)")
            assert full.startswith(head) and full.endswith(tail)


def test_every_workload_param_name_is_innocent() -> None:
    names = {path.rsplit(".", 1)[-1] for path in field_paths(SCHEMAS["job"])}
    assert {"prompt_tokens", "max_tokens", "account"} <= names
    assert [n for n in names if v.find_secret_keys({n: 1})] == []


def test_finite_values_only_from_json_but_nan_is_judged_alike() -> None:
    doc = copy.deepcopy(SEEDS["beacon"][0])
    doc["beacon"]["load"] = math.nan
    assert_agree("beacon", doc)
