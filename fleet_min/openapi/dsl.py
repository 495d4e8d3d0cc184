"""A compact way to write OpenAPI 3.1 documents in Python: schema helpers and a route table.

The two service descriptions (collector_api.py, controlplane_api.py) are written with these
helpers; build.py turns them into the committed JSON files. Conventions the helpers encode:

- `obj({"a": STR, "b?": INT})`: `b` is optional (the `?` is dropped), every other key required;
  objects stay open (extra keys allowed) unless `closed=True`, because replies grow additively.
- `null(x)`: x or JSON null.
- A route's errors are `{status: "when"}`; each becomes a response with the shared
  `{"error": "<sentence>"}` body. Path parameters are declared once, by name, in the service's
  PATH_PARAMS table, and picked up from the path template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from fleet_min.validate import load_schema

Schema = dict[str, Any]

STR: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
NUM: Schema = {"type": "number"}
BOOL: Schema = {"type": "boolean"}
ANY: Schema = {}
# The API's times: UTC ISO-8601 ending in Z (DESIGN.md, wire format).
TIME: Schema = {"type": "string", "format": "date-time", "pattern": "Z$"}
ERROR: Schema = {"$ref": "#/components/schemas/Error"}


def null(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def arr(items: Schema, **limits: Any) -> Schema:
    return {"type": "array", "items": items, **limits}


def enum(*values: Any) -> Schema:
    return {"enum": list(values)}


def string(**limits: Any) -> Schema:
    return {"type": "string", **limits}


def integer(low: int | None = None, high: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return schema


def obj(fields: dict[str, Schema] | None = None, closed: bool = False, **extra: Any) -> Schema:
    """An object; keys ending in '?' are optional. `extra` adds keywords (e.g. minProperties)."""
    props = {key.removesuffix("?"): value for key, value in (fields or {}).items()}
    schema: Schema = {"type": "object", "properties": props}
    required = [key for key in (fields or {}) if not key.endswith("?")]
    if required:
        schema["required"] = required
    if closed:
        schema["additionalProperties"] = False
    schema.update(extra)
    return schema


def map_of(values: Schema) -> Schema:
    return {"type": "object", "additionalProperties": values}


# --------------------------------------------------------------------------------------------
# Responses


@dataclass(frozen=True)
class Reply:
    description: str
    content: dict[str, Schema] | None = None  # media type -> schema
    headers: dict[str, Schema] = field(default_factory=dict)

    def render(self) -> dict[str, Any]:
        out: dict[str, Any] = {"description": self.description}
        if self.content is not None:
            out["content"] = {media: {"schema": schema} for media, schema in self.content.items()}
        if self.headers:
            out["headers"] = {name: {"schema": schema} for name, schema in self.headers.items()}
        return out


def json_reply(schema: Schema, description: str = "OK") -> Reply:
    return Reply(description, {"application/json": schema})


def html_reply(description: str) -> Reply:
    return Reply(description, {"text/html": STR})


def text_reply(description: str, media: str = "text/plain") -> Reply:
    return Reply(description, {media: STR})


def binary_reply(description: str, media: str = "application/octet-stream") -> Reply:
    return Reply(description, {media: {"type": "string", "format": "binary"}})


def empty_reply(description: str) -> Reply:
    return Reply(description)


def sse_reply(description: str, data: Schema, event: Schema | None = None) -> Reply:
    """text/event-stream; in OpenAPI 3.1 the schema describes one event, its `data` is JSON."""
    fields: dict[str, Schema] = {
        "data?": {"type": "string", "contentMediaType": "application/json",
                  "contentSchema": data},
        "id?": STR, "retry?": integer(0)}
    if event is not None:
        fields["event?"] = event
    return Reply(description, {"text/event-stream": obj(fields)})


# --------------------------------------------------------------------------------------------
# Parameters and bodies


@dataclass(frozen=True)
class Param:
    name: str
    schema: Schema
    description: str
    where: str = "query"
    required: bool = False
    allow_empty: bool = True  # an empty optional query value counts as not given

    def render(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "in": self.where, "schema": self.schema,
                               "description": self.description}
        if self.required or self.where == "path":
            out["required"] = True
        elif self.where == "query" and self.allow_empty:
            out["allowEmptyValue"] = True
        return out


def query(name: str, schema: Schema, description: str, required: bool = False,
          allow_empty: bool = True) -> Param:
    return Param(name, schema, description, "query", required, allow_empty)


def header(name: str, schema: Schema, description: str, required: bool = False) -> Param:
    return Param(name, schema, description, "header", required)


@dataclass(frozen=True)
class Body:
    schema: Schema
    description: str
    media: str = "application/json"
    required: bool = True

    def render(self) -> dict[str, Any]:
        return {"description": self.description, "required": self.required,
                "content": {self.media: {"schema": self.schema}}}


# --------------------------------------------------------------------------------------------
# Routes


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI template: /api/jobs/{job_id}
    summary: str
    replies: dict[int, Reply]
    errors: dict[int, str] = field(default_factory=dict)
    params: tuple[Param, ...] = ()
    body: Body | None = None
    tag: str = ""
    security: tuple[str, ...] = ()  # names of security schemes; () = open
    security_optional: bool = False  # the scheme applies only when the operator configured it
    description: str = ""


@dataclass
class Service:
    """Everything one document says: header, path parameters, components, routes."""

    title: str
    version: str
    description: str
    path_params: dict[str, Param]
    schemas: dict[str, Schema]
    security_schemes: dict[str, Schema]
    routes: list[Route]
    tags: list[tuple[str, str]]
    fallbacks: list[dict[str, Any]] = field(default_factory=list)


PATH_VARIABLE = re.compile(r"\{([^{}]+)\}")

# What both services answer before any route runs (fleet_min.origin): every request, to a Host
# they do not answer to; every change, from a page of another origin or with a body type any
# page can send.
MISDIRECTED = ("the Host is not an IP address, localhost, this machine's name or a name in "
               "FLEET_ALLOWED_HOSTS (a guard against DNS rebinding)")
FOREIGN_PAGE = "a page of another origin sent it (Origin, Sec-Fetch-Site: cross-site)"
SIMPLE_BODY = ("the body is text/plain, a form (urlencoded or multipart) or has no "
               "Content-Type: send JSON (artifact uploads: application/octet-stream)")
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def boundary_errors(route: Route) -> dict[int, str]:
    """The route's errors with the boundary's answers added."""
    errors = {**route.errors, 421: MISDIRECTED}
    if route.method in CHANGES:
        errors[415] = SIMPLE_BODY
        own = errors.get(403)
        if own is None:
            errors[403] = FOREIGN_PAGE
        elif "origin" not in own.lower() and "another site" not in own.lower():
            errors[403] = f"{own}; or {FOREIGN_PAGE}"
    return errors


def _operation(service: Service, route: Route) -> dict[str, Any]:
    names = PATH_VARIABLE.findall(route.path)
    params = [service.path_params[name].render() for name in names]
    params += [p.render() for p in route.params]
    responses: dict[str, Any] = {str(status): reply.render()
                                 for status, reply in sorted(route.replies.items())}
    for status, when in sorted(boundary_errors(route).items()):
        responses[str(status)] = json_reply(ERROR, when).render()
    op: dict[str, Any] = {"operationId": _operation_id(route), "summary": route.summary}
    if route.description:
        op["description"] = route.description
    if route.tag:
        op["tags"] = [route.tag]
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = route.body.render()
    op["responses"] = dict(sorted(responses.items()))
    if route.security:
        op["security"] = ([{}] if route.security_optional else []) + [
            {name: []} for name in route.security]
    return op


def _operation_id(route: Route) -> str:
    path = route.path + ("index" if route.path.endswith("/") else "")
    words = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_") or "root"
    return f"{route.method.lower()}_{words}"


def render(service: Service) -> dict[str, Any]:
    """The OpenAPI 3.1 document as a JSON-ready dict (keys in a stable order)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in service.routes:
        methods = paths.setdefault(route.path, {})
        key = route.method.lower()
        if key in methods:
            raise ValueError(f"{route.method} {route.path} is described twice")
        methods[key] = _operation(service, route)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": service.title, "version": service.version,
                 "description": service.description},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "tags": [{"name": name, "description": text} for name, text in service.tags],
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": dict(sorted(service.schemas.items())),
                       "securitySchemes": service.security_schemes},
    }
    if service.fallbacks:
        doc["x-fallback-routes"] = service.fallbacks
    return doc


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------------------------
# The project's JSON Schemas (fleet_min/schemas), embedded as components


def embed_schema(name: str, component: str, schemas: dict[str, Schema]) -> None:
    """Add fleet_min/schemas/<name>.json to `schemas` under `component`.

    Its `$defs` become components of their own (shared definitions that are identical in several
    files, such as jobId, are stored once) and its internal `#/$defs/x` references are rewritten
    to point at them, so the document needs no resolution of `$id` bases.
    """
    raw = load_schema(name)  # a fresh dict each call: changed here freely
    definitions: dict[str, Schema] = raw.pop("$defs", {})
    renames = {def_name: def_name for def_name in definitions}
    for def_name, definition in definitions.items():
        if def_name in schemas and schemas[def_name] != _rewrite(definition, renames):
            renames[def_name] = f"{name}.{def_name}"
    for def_name, definition in definitions.items():
        schemas[renames[def_name]] = _rewrite(definition, renames)
    for key in ("$schema", "$id", "$comment"):
        raw.pop(key, None)
    raw["description"] = (raw.get("description", "") + f" (fleet_min/schemas/{name}.json)").strip()
    schemas[component] = _rewrite(raw, renames)


def _rewrite(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
                name = value.removeprefix("#/$defs/")
                out[key] = f"#/components/schemas/{renames.get(name, name)}"
            elif key != "$comment":
                out[key] = _rewrite(value, renames)
        return out
    if isinstance(node, list):
        return [_rewrite(item, renames) for item in node]
    return node
