"""Write (or check) the committed OpenAPI documents from their Python descriptions.

    python -m fleet_min.openapi.build          rewrite fleet_min/openapi/*.json
    python -m fleet_min.openapi.build --check  exit 1 when a committed file is out of step
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fleet_min.openapi import collector_api, controlplane_api
from fleet_min.openapi.dsl import dumps, render

HERE = Path(__file__).resolve().parent
DESCRIPTIONS = {"collector": collector_api.service, "controlplane": controlplane_api.service}


def documents() -> dict[str, dict[str, Any]]:
    return {name: render(describe()) for name, describe in DESCRIPTIONS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="report files that differ instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    for name, doc in documents().items():
        path = HERE / f"{name}.json"
        text = dumps(doc)
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of step with their descriptions: {', '.join(stale)}; "
              "run python -m fleet_min.openapi.build", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
