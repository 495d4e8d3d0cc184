"""The control plane's imports form a tree: no module imports itself back through others, the
app is imported by the CLI alone (features never reach into it), and only the HTTP layer
(controlplane/http/) imports aiohttp.web."""

from __future__ import annotations

from pathlib import Path

from tests.support.imports import find_cycle, import_graph, importers, imports_of, modules

SRC = Path(__file__).resolve().parents[2]
PACKAGE = SRC / "fleet_min" / "controlplane"
HTTP = "fleet_min.controlplane.http"


def test_no_import_cycle_inside_the_control_plane() -> None:
    graph = import_graph(PACKAGE, SRC)
    assert len(graph) > 40  # every module was read
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_only_the_cli_imports_the_http_layer_and_nothing_imports_the_app_but_the_cli() -> None:
    graph = import_graph(PACKAGE, SRC)
    outside = {source: targets for source, targets in importers(graph, HTTP).items()
               if not source.startswith(HTTP + ".")}
    assert set(outside) <= {"fleet_min.controlplane.cli"}, outside
    app_users = set(importers(graph, HTTP + ".app"))
    assert app_users == {"fleet_min.controlplane.cli"}, app_users


def test_domain_modules_do_not_import_aiohttp_web() -> None:
    offenders = []
    for name, path in modules(PACKAGE, SRC).items():
        if name == HTTP or name.startswith(HTTP + "."):
            continue
        if {"aiohttp.web", "aiohttp.web_request", "aiohttp.web_response"} & imports_of(path):
            offenders.append(name)
    assert offenders == []


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
