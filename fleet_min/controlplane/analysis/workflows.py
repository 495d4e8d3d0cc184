"""Workflow files: what each job runs on, its matrix, its concurrency group, its schedules; and
the concurrency findings drawn from them. Pure functions over the files' text.

Parsed with PyYAML's safe loader (the C one when present). YAML 1.1 reads the key `on` as the
boolean true, so both spellings are looked up. A file that is too large, not YAML, or not a
mapping, or nested or aliased past the bounds below, yields an error instead of a model;
nothing in a file can make the parser run code, crash the process or fill its memory.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import yaml

try:
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # the pure-Python build inside fleet.pyz
    _Loader = yaml.SafeLoader

MAX_FILE_BYTES = 512 * 1024
# A file's shape, read from the parser's events before anything is built from them. The
# loader builds nested collections by recursion: a 60 KB file of brackets 30,000 deep crashed
# the C loader (a segfault; the file is kept in SQLite, so every restart crashed again) and
# raised RecursionError in the pure-Python one. Aliases repeat what an anchor names: a 500-byte
# file of nested anchors expanded to 312 MB in one name. GitHub's own workflows nest a dozen
# levels and expand to their own size; these bounds are far above that.
MAX_DEPTH = 64
MAX_EXPANDED_BYTES = 8 * MAX_FILE_BYTES
MATRIX_ENUMERATION_CAP = 4096  # beyond this the product is reported, not enumerated
GITHUB_MATRIX_LIMIT = 256      # GitHub refuses larger matrices per workflow run


@dataclass
class Matrix:
    size: int | None           # combinations; None when built from an expression
    expression: bool           # some part of it is an expression (unbounded)
    max_parallel: int | None
    values: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class Job:
    key: str
    name: str
    labels: list[str] | None   # None: runs-on is an expression we cannot resolve
    self_hosted: bool | None
    matrix: Matrix | None
    group: str | None          # job-level concurrency group
    reusable: bool = False     # `uses:` a reusable workflow (its jobs are elsewhere)


@dataclass
class Schedule:
    cron: str
    timezone: str              # IANA name; GitHub's default is UTC


@dataclass
class Workflow:
    path: str
    name: str
    group: str | None = None   # workflow-level concurrency group
    jobs: list[Job] = field(default_factory=list)
    schedules: list[Schedule] = field(default_factory=list)
    error: str | None = None


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and "${{" in value


def parse(path: str, text: str) -> Workflow:
    name = path.rsplit("/", 1)[-1]
    if len(text.encode("utf-8", "replace")) > MAX_FILE_BYTES:
        return Workflow(path, name, error=f"larger than {MAX_FILE_BYTES // 1024} KiB; skipped")
    try:
        shape = _shape_problem(text)
        if shape:
            return Workflow(path, name, error=f"{shape}; skipped")
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader, chosen above
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return Workflow(path, name, error=f"not valid YAML{where}")
    if not isinstance(doc, dict):
        return Workflow(path, name, error="not a YAML mapping")
    flow = Workflow(path, _text(doc.get("name")) or name, group=_group(doc.get("concurrency")))
    flow.schedules = _schedules(doc.get("on", doc.get(True)))
    jobs = doc.get("jobs")
    if isinstance(jobs, dict):
        flow.jobs = [_job(str(key), body) for key, body in jobs.items() if isinstance(body, dict)]
    return flow


def _shape_problem(text: str) -> str | None:
    """Why a file is not loaded, from the parser's events alone (which the parser yields
    without recursion): collections nested deeper than MAX_DEPTH, or aliases that would make
    the document larger than MAX_EXPANDED_BYTES (each scalar counts its length, each
    collection one, an alias what its anchor counted)."""
    open_sizes: list[list[Any]] = []  # [anchor, size so far] of each open collection
    anchored: dict[str, int] = {}
    expanded = 0
    for event in yaml.parse(text, Loader=_Loader):
        size: int | None = None
        anchor = getattr(event, "anchor", None)
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_sizes) >= MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            open_sizes.append([anchor, 1])
            expanded += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_sizes.pop()
        elif isinstance(event, yaml.ScalarEvent):
            size = len(event.value) + 1
            expanded += size
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, anchored.get(event.anchor or "", 1)
            expanded += size
        if size is None:
            continue
        if anchor is not None:
            anchored[anchor] = size
        if open_sizes:
            open_sizes[-1][1] += size
        if expanded > MAX_EXPANDED_BYTES:
            return (f"its aliases expand it past {MAX_EXPANDED_BYTES // (1 << 20)} MiB "
                    "(nested YAML anchors)")
    return None


def _text(value: Any) -> str | None:
    """A name as text: a string or number as written; anything else (a list or mapping,
    which an alias can make any size) is no name."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def _group(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("group")
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    return None


# A workflow's schedules the forecast reads. A real file lists a few; one alias repeated
# 20,000 times fits in 180 KB, and every due minute of every schedule was a run the forecast
# listed (12 s and 178 MB an answer, the event loop held 10 s each analysis round).
MAX_SCHEDULES = 64


def _schedules(on: Any) -> list[Schedule]:
    if not isinstance(on, dict) or not isinstance(on.get("schedule"), list):
        return []
    out = []
    for entry in on["schedule"]:
        if isinstance(entry, dict) and isinstance(entry.get("cron"), str):
            zone = entry.get("timezone")
            out.append(Schedule(entry["cron"], zone if isinstance(zone, str) and zone else "UTC"))
            if len(out) > MAX_SCHEDULES:
                break  # one past the bound: schedule_prediction says the rest were not read
    return out


def _job(key: str, body: dict[str, Any]) -> Job:
    raw = body.get("strategy")
    strategy: dict[str, Any] = raw if isinstance(raw, dict) else {}
    matrix = _matrix(strategy.get("matrix"), strategy.get("max-parallel")) \
        if "matrix" in strategy else None
    labels = _labels(body.get("runs-on"), matrix)
    return Job(key=key, name=_text(body.get("name")) or key, labels=labels,
               self_hosted=None if labels is None else any(
                   label.lower() == "self-hosted" for label in labels) or _grouped(body),
               matrix=matrix, group=_group(body.get("concurrency")),
               reusable="uses" in body and "runs-on" not in body)


def _grouped(body: dict[str, Any]) -> bool:
    """runs-on: {group: ...} selects a runner group: self-hosted (or larger) runners."""
    runs_on = body.get("runs-on")
    return isinstance(runs_on, dict) and "group" in runs_on


def _labels(runs_on: Any, matrix: Matrix | None) -> list[str] | None:
    if isinstance(runs_on, dict):
        runs_on = runs_on.get("labels", [])
    items = runs_on if isinstance(runs_on, list) else [runs_on] if runs_on is not None else []
    labels: list[str] = []
    for item in items:
        if not isinstance(item, str):
            continue
        if is_expression(item):
            resolved = _matrix_reference(item, matrix)
            if resolved is None:
                return None
            labels += resolved
        else:
            labels.append(item)
    return labels


def _matrix_reference(text: str, matrix: Matrix | None) -> list[str] | None:
    """`${{ matrix.os }}` resolves to the values of a static matrix dimension."""
    inner = text.strip().removeprefix("${{").removesuffix("}}").strip()
    if matrix is None or not inner.startswith("matrix.") or text.count("${{") != 1:
        return None
    values = matrix.values.get(inner[len("matrix."):])
    if not values:
        return None
    out: list[str] = []
    for value in values:
        out += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return out


def _matrix(raw: Any, max_parallel: Any) -> Matrix:
    limit = max_parallel if isinstance(max_parallel, int) and not isinstance(
        max_parallel, bool) and max_parallel > 0 else None
    if not isinstance(raw, dict):
        return Matrix(None, True, limit)
    dims = {k: v for k, v in raw.items() if k not in ("include", "exclude")}
    include, exclude = raw.get("include", []), raw.get("exclude", [])
    if (any(not isinstance(v, list) for v in dims.values()) or is_expression(include)
            or is_expression(exclude) or not isinstance(include, list)
            or not isinstance(exclude, list)):
        return Matrix(None, True, limit, {k: v for k, v in dims.items() if isinstance(v, list)})
    product = 1
    for values in dims.values():
        product *= len(values)
    if product > MATRIX_ENUMERATION_CAP:
        return Matrix(product, False, limit, dims)
    return Matrix(_combinations(dims, include, exclude), False, limit, dims)


def _combinations(dims: dict[str, list[Any]], include: list[Any], exclude: list[Any]) -> int:
    """GitHub's rules: exclude drops the combinations it matches; an include entry extends every
    combination whose original values it does not contradict, or is added as a new one."""
    keys = list(dims)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*dims.values())]
    if not keys:
        combos = []
    combos = [c for c in combos if not any(
        isinstance(e, dict) and e and all(c.get(k) == v for k, v in e.items()) for e in exclude)]
    added = 0
    for entry in include:
        if not isinstance(entry, dict):
            continue
        originals = {k: v for k, v in entry.items() if k in dims}
        if not combos or not any(all(c.get(k) == v for k, v in originals.items())
                                 for c in combos):
            added += 1
    return len(combos) + added


# --- findings -----------------------------------------------------------------------------------

def _finding(kind: str, severity: str, repo: str, message: str, **detail: Any) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "repo": repo, "message": message, **detail}


def matching_runners(labels: list[str], runners: list[dict[str, Any]]) -> int:
    wanted = {label.lower() for label in labels}
    return sum(1 for r in runners if wanted <= {x.lower() for x in r.get("labels", [])})


def findings(repo: str, flows: list[Workflow], runners: list[dict[str, Any]] | None
             ) -> list[dict[str, Any]]:
    """Concurrency findings of one repository's workflow files (runners: GitHub's list)."""
    out: list[dict[str, Any]] = []
    for flow in flows:
        out += _matrix_findings(repo, flow, runners)
        out += _missing_group(repo, flow)
    return out + _collisions(repo, flows)


def _matrix_findings(repo: str, flow: Workflow, runners: list[dict[str, Any]] | None
                     ) -> list[dict[str, Any]]:
    out = []
    # Runners matched once per set of labels: a file may hold thousands of jobs of one set.
    matched: dict[tuple[str, ...], int] = {}
    for job in flow.jobs:
        m = job.matrix
        if m is None:
            continue
        where = {"file": flow.path, "workflow": flow.name, "job": job.key}
        if m.expression:
            out.append(_finding(
                "unbounded-matrix", "warning" if job.self_hosted else "info", repo,
                f"{flow.path}: job {job.key} builds its matrix from an expression, so how many "
                "jobs it starts is only known at run time"
                + ("" if m.max_parallel else " and no max-parallel bounds it"),
                max_parallel=m.max_parallel, **where))
            continue
        if not job.self_hosted or m.size is None or runners is None or job.labels is None:
            continue
        labels = tuple(job.labels)
        if labels not in matched:
            matched[labels] = matching_runners(job.labels, runners)
        have = matched[labels]
        parallel = min(m.size, m.max_parallel or m.size)
        if parallel > have:
            out.append(_finding(
                "matrix-exceeds-runners", "warning", repo,
                f"{flow.path}: job {job.key} starts {m.size} matrix jobs"
                + (f" (max-parallel {m.max_parallel})" if m.max_parallel else "")
                + f" for {have} runner(s) with labels {', '.join(job.labels)}; "
                f"{parallel - have} wait each time", matrix_size=m.size,
                max_parallel=m.max_parallel, runners=have, labels=job.labels, **where))
    return out


def _missing_group(repo: str, flow: Workflow) -> list[dict[str, Any]]:
    if flow.group is not None:
        return []
    bare = [job.key for job in flow.jobs if job.self_hosted and job.group is None]
    if not bare:
        return []
    return [_finding(
        "missing-concurrency", "info", repo,
        f"{flow.path}: job(s) {', '.join(bare)} run on self-hosted runners with no concurrency "
        "group, so superseded runs (quick pushes to one branch) still take runners",
        file=flow.path, workflow=flow.name, jobs=bare)]


def _collisions(repo: str, flows: list[Workflow]) -> list[dict[str, Any]]:
    """Static (expression-free) groups declared in more than one place share one slot: their
    runs wait for (or cancel) each other even when unrelated."""
    users: dict[str, list[dict[str, str]]] = defaultdict(list)
    for flow in flows:
        if flow.group and not is_expression(flow.group):
            users[flow.group].append({"file": flow.path, "job": "(workflow)"})
        for job in flow.jobs:
            if job.group and not is_expression(job.group):
                users[job.group].append({"file": flow.path, "job": job.key})
    out = []
    for group, places in sorted(users.items()):
        if len(places) < 2:
            continue
        files = sorted({p["file"] for p in places})
        # A job in a file whose workflow holds the same group: each place looked at once (a
        # job's look through every other place took 11 s for a file of 12,000 such jobs).
        whole = {p["file"] for p in places if p["job"] == "(workflow)"}
        deadlock = any(p["job"] != "(workflow)" and p["file"] in whole for p in places)
        where = "within " + files[0] if len(files) == 1 else "across " + ", ".join(files)
        out.append(_finding(
            "static-group-collision", "critical" if deadlock else "warning", repo,
            f"concurrency group {group!r} is declared {len(places)} times {where}"
            + ("; a job sharing its workflow's group waits for itself (deadlock)" if deadlock
               else "; those runs queue behind (or cancel) each other"),
            group=group, places=places[:MAX_PLACES], places_total=len(places)))
    return out


MAX_PLACES = 100  # places a collision finding lists (places_total counts them all)
