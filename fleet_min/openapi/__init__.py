"""The OpenAPI 3.1 documents of both services, kept in the package and served at /openapi.json.

`collector.json` and `controlplane.json` are generated from the Python descriptions beside them
(`python -m fleet_min.openapi.build`; docs/api.md says how they are kept in step) and read here
through importlib.resources, so they are served from fleet.pyz too.
"""

from __future__ import annotations

import functools
from importlib import resources

DOCUMENTS = ("collector", "controlplane")


@functools.cache
def document_bytes(name: str) -> bytes:
    """The committed JSON document of one service, read once."""
    if name not in DOCUMENTS:
        raise ValueError(f"no OpenAPI document named {name!r}")
    return resources.files(__name__).joinpath(f"{name}.json").read_bytes()
