"""fleet.pyz for tests: build it, run it with a cache folder of the test's own, and read or
plant entries of its bytecode cache (the format fleet_min/zipstart.py documents, written here
independently of it)."""

from __future__ import annotations

import importlib.util
import marshal
import os
import subprocess
import sys
import zlib
from pathlib import Path

from tests.support.collector import ROOT


def build(out: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "zipapp.py"), "-o", str(out)], check=True,
                   capture_output=True, timeout=180)
    return out


def env(cache_home: Path, **extra: str) -> dict[str, str]:
    """This environment with the cache under `cache_home`, no checkout on the path, and nothing
    that would stop bytecode being written."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONDONTWRITEBYTECODE", "CACHE_DIRECTORY")}
    return {**base, "XDG_CACHE_HOME": str(cache_home), "PYTHONPATH": "", **extra}


def run(pyz: Path, args: list[str], cache_home: Path, *, flags: tuple[str, ...] = (),
        prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`python -I [flags] fleet.pyz args`, from the pyz's folder (no checkout on the path)."""
    return subprocess.run([*prefix, sys.executable, "-I", *flags, str(pyz), *args],
                          capture_output=True, text=True, timeout=120, cwd=pyz.parent,
                          env=env(cache_home))


def folders(cache_home: Path) -> list[Path]:
    """The cache folders (one per build and Python) under `cache_home`."""
    return sorted(cache_home.glob("fleet-min/*/*"))


def folder(cache_home: Path) -> Path:
    found = folders(cache_home)
    assert len(found) == 1, found
    assert found[0].name == sys.implementation.cache_tag
    return found[0]


def entry(code_bytes: bytes, magic: bytes = importlib.util.MAGIC_NUMBER) -> bytes:
    """A cache entry: magic number, CRC-32 and length of the marshalled code, the code."""
    return (magic + zlib.crc32(code_bytes).to_bytes(4, "little")
            + len(code_bytes).to_bytes(4, "little") + code_bytes)


def plant(cache: Path, module: str, source: str) -> Path:
    """Write a valid entry for `module` whose code is `source`."""
    path = cache / f"{module}.pyc"
    path.write_bytes(entry(marshal.dumps(compile(source, f"planted {module}", "exec"))))
    return path


def holds_code(path: Path) -> bool:
    """Whether `path` is a whole entry of this Python's code."""
    data = path.read_bytes()
    payload = data[12:]
    return (data[:4] == importlib.util.MAGIC_NUMBER
            and int.from_bytes(data[4:8], "little") == zlib.crc32(payload)
            and int.from_bytes(data[8:12], "little") == len(payload)
            and type(marshal.loads(payload)).__name__ == "code")
