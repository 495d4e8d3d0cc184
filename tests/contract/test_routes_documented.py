"""Every route of each service is in its OpenAPI document, and every documented operation is a
route: the router's (method, path template) set is compared with the document's paths.

aiohttp adds a HEAD twin to every GET; those are implied by the GET and left out, except where
the document describes HEAD on its own (artifact downloads). A catch-all route registered for
every method ("*") must be described for GET, POST, PUT, PATCH and DELETE, or listed in the
document's `x-fallback-routes` (the 404 for unknown /api paths).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fleet_min import openapi
from fleet_min.collector.http.app import create_app as create_collector
from fleet_min.config import COLLECTOR_SETTINGS, resolve
from fleet_min.controlplane.http.app import create_app as create_controlplane
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS
from fleet_min.openapi import build
from fleet_min.validate import load_schema

EVERY_METHOD = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def router_routes(app: web.Application) -> set[tuple[str, str]]:
    routes = set()
    for route in app.router.routes():
        resource = route.resource
        assert resource is not None
        routes.add((route.method, resource.canonical))
    return routes


def document_routes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items()
            for method in item if method in HTTP_METHODS}


def differences(app: web.Application, doc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(routes the document does not describe, documented operations the router lacks)."""
    served = router_routes(app)
    described = document_routes(doc)
    fallbacks = {(m, f["path"]) for f in doc.get("x-fallback-routes", []) for m in f["methods"]}
    gets = {path for method, path in served if method == "GET"}
    undocumented, unserved = [], []
    for method, path in sorted(served):
        if method == "HEAD" and path in gets and ("HEAD", path) not in described:
            continue  # aiohttp's automatic twin of a GET
        if method == "*":
            if ("*", path) in fallbacks:
                continue
            missing = {m for m in EVERY_METHOD if (m, path) not in described}
            undocumented += [f"{m} {path} (a catch-all route)" for m in sorted(missing)]
            continue
        if (method, path) not in described:
            undocumented.append(f"{method} {path}")
    catch_alls = {path for method, path in served if method == "*"}
    for method, path in sorted(described):
        if (method, path) in served or path in catch_alls:
            continue
        if method == "HEAD" and path in gets:
            continue
        unserved.append(f"{method} {path}")
    return undocumented, unserved


@pytest.fixture
def collector_app(tmp_path: Path) -> web.Application:
    config = resolve(COLLECTOR_SETTINGS, environ={}, data_dir=str(tmp_path / "data"))
    return create_collector(config)


@pytest.fixture
def controlplane_app(tmp_path: Path) -> web.Application:
    environ = {"FLEET_ROOT": str(tmp_path / "runners"), "FLEET_STATE_DIR": str(tmp_path / "st"),
               "HOME": str(tmp_path)}
    config = resolve(CONTROLPLANE_SETTINGS, {}, environ=environ)
    return create_controlplane(config, environ)


def _document(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(openapi.document_bytes(name))
    return loaded


def test_every_collector_route_is_documented_and_back(collector_app: web.Application) -> None:
    undocumented, unserved = differences(collector_app, _document("collector"))
    assert not undocumented, f"routes missing from collector.json: {undocumented}"
    assert not unserved, f"collector.json describes routes the collector lacks: {unserved}"


def test_every_controlplane_route_is_documented_and_back(
        controlplane_app: web.Application) -> None:
    undocumented, unserved = differences(controlplane_app, _document("controlplane"))
    assert not undocumented, f"routes missing from controlplane.json: {undocumented}"
    assert not unserved, f"controlplane.json describes routes the control plane lacks: {unserved}"


def test_the_comparison_catches_a_route_on_either_side(collector_app: web.Application) -> None:
    doc = _document("collector")
    async def extra(request: web.Request) -> web.Response:
        return web.Response()

    collector_app.router.add_post("/api/undocumented/{thing}", extra)
    undocumented, _ = differences(collector_app, doc)
    assert undocumented == ["POST /api/undocumented/{thing}"]
    doc["paths"]["/api/imaginary"] = {"delete": {"responses": {}}}
    _, unserved = differences(collector_app, doc)
    assert unserved == ["DELETE /api/imaginary"]


def test_committed_documents_match_their_descriptions() -> None:
    assert build.main(["--check"]) == 0, "run python -m fleet_min.openapi.build"


@pytest.mark.parametrize("name", openapi.DOCUMENTS)
def test_documents_are_valid_openapi_3_1(name: str) -> None:
    from openapi_spec_validator import validate

    doc = _document(name)
    assert doc["openapi"].startswith("3.1.")
    validate(doc)


@pytest.mark.parametrize("name", openapi.DOCUMENTS)
def test_every_operation_documents_its_errors_as_the_error_shape(name: str) -> None:
    """Every 4xx/5xx reply is {"error": "<sentence>"} (JSON) or an HTML page for pages."""
    doc = _document(name)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for status, reply in op["responses"].items():
                if not re.fullmatch(r"[45]\d\d", status):
                    continue
                content = reply.get("content", {})
                assert content, f"{method} {path} {status} has no body"
                if "application/json" in content:
                    assert content["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/Error"}, f"{method} {path} {status}"
                else:
                    assert set(content) == {"text/html"}, f"{method} {path} {status}"


def test_embedded_job_schema_is_the_schema_file() -> None:
    """The request bodies reuse fleet_min/schemas/*.json: same keywords, refs rewritten."""
    doc = _document("collector")
    schemas = doc["components"]["schemas"]
    raw = load_schema("job")
    assert schemas["JobSpec"]["required"] == raw["required"]
    assert set(schemas["JobSpec"]["properties"]) == set(raw["properties"])
    text = json.dumps(schemas)
    assert "#/$defs/" not in text
    for name in raw["$defs"]:
        assert name in schemas or f"job.{name}" in schemas
