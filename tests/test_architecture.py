"""The shape of the house, read from the source with ast (nothing is imported; every import
statement counts, under TYPE_CHECKING and inside functions too): fleet_min's imports have no
cycle; the two services never import each other; the shared modules import neither (only the
CLI that starts them does); the agent imports nothing of fleet_min; and the collector's rooms
(docs/architecture.md) form a tree whose HTTP layer alone speaks aiohttp.web. The walk of a job
in docs/architecture.md names only functions that exist, in the modules it names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.imports import find_cycle, import_graph, importers, imports_of, modules

SRC = Path(__file__).resolve().parents[1]
PACKAGE = SRC / "fleet_min"
COLLECTOR = "fleet_min.collector"
CONTROLPLANE = "fleet_min.controlplane"
SERVICES = (COLLECTOR, CONTROLPLANE)
ENTRY_POINTS = {"fleet_min.cli", "fleet_min.__main__"}  # start either service
WEB = {"aiohttp.web", "aiohttp.web_request", "aiohttp.web_response"}


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _graph() -> dict[str, set[str]]:
    graph = import_graph(PACKAGE, SRC)
    assert len(graph) > 120  # every module was read
    return graph


def test_fleet_min_has_no_import_cycle():
    cycle = find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_services_never_import_each_other():
    graph = _graph()
    crossing = {f"{source} -> {target}" for source, targets in graph.items()
                for target in targets for a, b in (SERVICES, SERVICES[::-1])
                if _inside(source, a) and _inside(target, b)}
    assert crossing == set()


def test_only_the_entry_points_of_the_shared_modules_import_a_service():
    graph = _graph()
    users = {source for prefix in SERVICES for source in importers(graph, prefix)
             if not any(_inside(source, p) for p in SERVICES)}
    assert users <= ENTRY_POINTS, users


def test_the_agent_imports_nothing_of_fleet_min():
    imported = imports_of(SRC / "agent" / "fleet_agent.py")
    assert imported  # the file was read
    assert {name for name in imported if _inside(name, "fleet_min")} == set()


def _room(module: str) -> str | None:
    """The collector's room a module is in (its first folder, or the module at the top)."""
    if not _inside(module, COLLECTOR) or module == COLLECTOR:
        return None
    return module.split(".")[2]


def test_the_collectors_rooms_form_a_tree():
    rooms: dict[str, set[str]] = {}
    for source, targets in _graph().items():
        here = _room(source)
        if here is None:
            continue
        rooms.setdefault(here, set()).update(
            room for room in map(_room, targets) if room not in (None, here))
    assert {"http", "jobs", "service", "storage", "cli"} <= set(rooms)
    cycle = find_cycle(rooms)
    assert cycle is None, " -> ".join(cycle or [])
    assert rooms["jobs"] == set()  # the job's path depends on no other room
    assert not any("http" in targets for room, targets in rooms.items() if room != "cli")


def test_only_the_collectors_http_layer_and_cli_import_aiohttp_web():
    offenders = [name for name, path in modules(PACKAGE / "collector", SRC).items()
                 if WEB & imports_of(path) and not _inside(name, COLLECTOR + ".http")
                 and name != COLLECTOR + ".cli"]
    assert offenders == []


def test_a_crossing_and_a_shared_module_importing_a_service_would_be_found():
    graph = {"fleet_min.collector.jobs.queue": {"fleet_min.controlplane.state"},
             "fleet_min.db": {"fleet_min.collector.service"}}
    assert [s for s, t in graph.items() for x in t
            if _inside(s, COLLECTOR) and _inside(x, CONTROLPLANE)] == [
        "fleet_min.collector.jobs.queue"]
    assert set(importers(graph, COLLECTOR)) == {"fleet_min.db"}


# -- the job's walk in docs/architecture.md ------------------------------------------------------

WALK = re.compile(r"<!-- walk:begin -->\n(.*?)<!-- walk:end -->", re.S)


def _defined(path: Path) -> set[str]:
    """The functions and classes a module defines, and its classes' methods as Class.method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
    return names


def walk_steps(text: str) -> list[tuple[str, str]]:
    """(module file, function) of each step: a backticked name belongs to the file named last,
    or to that file's class when it is a bare method name of one named before it."""
    steps = []
    module = ""
    for item in re.findall(r"`([^`]+)`", text):
        if item.endswith(".py"):
            module = item if item.startswith("fleet_min/") else f"fleet_min/{item}"
        else:
            steps.append((module, item))
    return steps


def test_every_step_of_the_jobs_walk_names_a_function_its_module_defines():
    text = (SRC / "docs" / "architecture.md").read_text(encoding="utf-8")
    walk = WALK.search(text)
    assert walk, "docs/architecture.md lost its walk markers"
    steps = walk_steps(walk.group(1))
    assert len(steps) > 40
    missing = []
    for module, name in steps:
        path = SRC / module
        defined = _defined(path) if path.is_file() else set()
        classes = {n.split(".")[0] for n in defined if "." in n}
        if name not in defined and not any(f"{c}.{name}" in defined for c in classes):
            missing.append(f"{module} {name}")
    assert missing == []


def test_the_walk_check_finds_a_name_that_is_gone():
    steps = walk_steps("1. `collector/jobs/queue.py` `enqueue` → `no_such_step`; "
                       "`fleet_min/db.py` `Database.write`")
    assert steps == [("fleet_min/collector/jobs/queue.py", "enqueue"),
                     ("fleet_min/collector/jobs/queue.py", "no_such_step"),
                     ("fleet_min/db.py", "Database.write")]
    assert "no_such_step" not in _defined(SRC / steps[1][0])
