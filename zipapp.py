"""Build dist/fleet.pyz: fleet_min and the pure-Python parts of its runtime dependencies in one
file that runs on a bare Python 3.11+ (`python fleet.pyz collector`).

The dependencies are taken from the installed distributions of this interpreter (so run it where
`pip install .` has been done), following their requirement metadata. Compiled accelerators
(.so/.pyd) are left out: aiohttp, multidict, yarl, frozenlist and propcache all fall back to their
pure-Python implementations when the extension cannot be imported, which is the case inside a zip.
So are files no service reads: type stubs and markers, Cython sources, aiohttp's test tools
and gunicorn workers (LEFT_OUT), the test suites some distributions ship inside their package,
and the project's own build tools (BUILD_ONLY). Each vendored distribution's licence files go under
`licenses/<name>/`; a file whose text is byte for byte one stored already (several packages ship
the same licence) is a one-line pointer to it (SAME_TEXT). The OpenAPI documents go in compact
(COMPACTED_JSON).

The archive holds sources and no bytecode: `__main__.py` (fleet_min/zipstart.py, with the build's
digest written in) compiles each module once per Python version and keeps its code in a cache
folder outside the archive (see that module for where and how it is kept safe).

The archive is reproducible: entries are sorted, timestamps fixed, and nothing in it depends on
the Python that built it, so the same sources give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import stat
import sys
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent
RUNTIME = ("aiohttp", "aiosqlite", "PyYAML", "pypng", "segno")
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
SKIP_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".c", ".pyx", ".pxd", ".pxi", ".pyi", ".h",
                 ".pyc", "py.typed")
# Vendored modules no service imports: aiohttp's pytest tools and its gunicorn workers (gunicorn
# is not in the archive, so they could not run anyway). A distribution's own test suite (a
# `tests` or `test` package inside it, as aiosqlite ships) is left out too.
LEFT_OUT = frozenset({"aiohttp/test_utils.py", "aiohttp/pytest_plugin.py", "aiohttp/worker.py"})
TEST_PACKAGES = frozenset({"tests", "test"})
# The project's build tools: the OpenAPI documents' Python descriptions and their builder. The
# services read the generated JSON (fleet_min.openapi.document_bytes), never these.
BUILD_ONLY = frozenset({"fleet_min/openapi/build.py", "fleet_min/openapi/collector_api.py",
                        "fleet_min/openapi/controlplane_api.py", "fleet_min/openapi/dsl.py"})
# The generated OpenAPI documents are indented in the tree, for people reading diffs; the
# services parse or serve them whole, so the archive keeps them compact (8 KB less of it).
COMPACTED_JSON = frozenset({"fleet_min/openapi/collector.json",
                            "fleet_min/openapi/controlplane.json"})
START = ROOT / "fleet_min" / "zipstart.py"  # becomes __main__.py
BUILD_ID_LINE = 'BUILD_ID = ""'


def _marker_holds(requirement: str) -> bool:
    """Evaluate a requirement's environment marker for this interpreter (extras never hold)."""
    if ";" not in requirement:
        return True
    marker = requirement.split(";", 1)[1]
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.markers import Marker
    return bool(Marker(marker.strip()).evaluate())


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0]


def runtime_distributions(roots: tuple[str, ...] = RUNTIME) -> list[metadata.Distribution]:
    """The runtime dependencies and everything they need, each once."""
    seen: dict[str, metadata.Distribution] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        dist = metadata.distribution(name)
        seen[key] = dist
        pending += [_name(r) for r in dist.requires or [] if _marker_holds(r)]
    return [seen[key] for key in sorted(seen)]


def _dist_entries(dist: metadata.Distribution) -> dict[str, bytes]:
    entries: dict[str, bytes] = {}
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    for file in dist.files or []:
        parts = PurePosixPath(str(file)).parts
        if not parts or parts[0].startswith("..") or "__pycache__" in parts:
            continue
        path = Path(str(file.locate()))
        top = parts[0]
        if top.endswith(".dist-info"):
            lowered = parts[-1].lower()
            if lowered.startswith(("license", "licence", "copying", "notice", "authors")):
                entries[f"licenses/{name}/{'/'.join(parts[1:])}"] = path.read_bytes()
            continue
        if top in ("bin", "share") or top.endswith((".pth", ".data")):
            continue
        if (str(file).endswith(SKIP_SUFFIXES) or str(file) in LEFT_OUT
                or (len(parts) > 2 and parts[1] in TEST_PACKAGES)):
            continue
        entries["/".join(parts)] = path.read_bytes()
    return entries


SAME_TEXT = "The same text as {first}, in this archive.\n"


def _fold_licences(entries: dict[str, bytes]) -> None:
    """Each licence text once: a later copy of the same bytes becomes a pointer to the first
    (in the order of names). Eight of the seventeen files repeated another's text, 16 KB of the
    archive."""
    first: dict[bytes, str] = {}
    for name in sorted(n for n in entries if n.startswith("licenses/")):
        text = entries[name]
        if text in first:
            entries[name] = SAME_TEXT.format(first=first[text]).encode()
        else:
            first[text] = name


def _project_entries() -> dict[str, bytes]:
    entries: dict[str, bytes] = {}
    package = ROOT / "fleet_min"
    for path in sorted(package.rglob("*")):
        name = path.relative_to(ROOT).as_posix()
        if (path.is_dir() or "__pycache__" in path.parts or path.suffix == ".pyc"
                or path == START or name in BUILD_ONLY):
            continue
        data = path.read_bytes()
        if name in COMPACTED_JSON:
            data = json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False).encode()
        entries[name] = data
    return entries


def _main_entry(entries: dict[str, bytes]) -> bytes:
    """zipstart.py with BUILD_ID set to a digest of the other entries and of itself: the name of
    this build's bytecode cache folder, so no two different archives share one."""
    source = START.read_text(encoding="utf-8")
    if source.count(BUILD_ID_LINE) != 1:
        raise RuntimeError(f"{START} must hold the line {BUILD_ID_LINE!r} exactly once")
    digest = hashlib.sha256(source.encode())
    for name in sorted(entries):
        digest.update(b"%s\0%d\0" % (name.encode(), len(entries[name])))
        digest.update(entries[name])
    return source.replace(BUILD_ID_LINE, f'BUILD_ID = "{digest.hexdigest()[:32]}"').encode()


def build(output: Path) -> str:
    entries: dict[str, bytes] = {}
    for dist in runtime_distributions():
        entries.update(_dist_entries(dist))
    _fold_licences(entries)
    entries.update(_project_entries())
    entries["__main__.py"] = _main_entry(entries)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".tmp")
    with open(tmp, "wb") as raw:
        raw.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for name in sorted(entries):
                info = zipfile.ZipInfo(name, FIXED_TIME)
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, entries[name], compresslevel=9)
    tmp.chmod(0o755)
    tmp.replace(output)
    return hashlib.sha256(output.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=str(ROOT / "dist" / "fleet.pyz"))
    args = parser.parse_args(argv)
    try:
        digest = build(Path(args.output))
    except metadata.PackageNotFoundError as exc:
        print(f"zipapp.py: {exc.args[0]} is not installed; run `pip install .` first",
              file=sys.stderr)
        return 1
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output} ({size // 1024} KiB, sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
