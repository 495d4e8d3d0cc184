"""fleet.pyz's bytecode cache (fleet_min/zipstart.py): a real second start reads it; an entry that
is not whole, or a folder someone else could have written, is never used; a home that cannot be
written still starts, compiling from the archive."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import pyz as pyzs

PLANTED = 'def main(argv=None):\n    print("planted entry ran")\n    return 0\n'
VERSION = "fleet-min "


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pyzs.build(tmp_path_factory.mktemp("pyz") / "fleet.pyz")


def _started(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_archive_holds_no_bytecode_and_names_its_build(pyz: Path) -> None:
    with zipfile.ZipFile(pyz) as archive:
        names = archive.namelist()
        main = archive.read("__main__.py").decode()
    assert not [n for n in names if n.endswith(".pyc")]
    assert "fleet_min/cli.py" in names and "aiohttp/web.py" in names
    # pypng, the visual review's PNG decoder, with its licence; not its command-line scripts.
    assert "png.py" in names and any(n.startswith("licenses/pypng/") for n in names)
    assert not [n for n in names if n.startswith("bin/")]
    assert 'BUILD_ID = ""' not in main and "BUILD_ID = \"" in main


def test_the_archive_leaves_out_what_no_service_reads_and_keeps_to_its_size(
        pyz: Path, tmp_path: Path) -> None:
    """The OpenAPI documents' builder and a dependency's own test suite are not in the archive;
    the documents themselves are, read from inside it. The size is a target of its own (a
    Raspberry Pi downloads the file; docs/performance.md): a change that grows the archive past
    it has to win the room back or move the target on purpose."""
    with zipfile.ZipFile(pyz) as archive:
        names = set(archive.namelist())
    assert not {"fleet_min/openapi/build.py", "fleet_min/openapi/collector_api.py",
                "fleet_min/openapi/controlplane_api.py", "fleet_min/openapi/dsl.py"} & names
    assert not [n for n in names if n.startswith("aiosqlite/tests/")]
    assert {"fleet_min/openapi/collector.json", "aiosqlite/core.py"} <= names
    read = subprocess.run(
        [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "from fleet_min.openapi import document_bytes; import json; "
         "print(*(json.loads(document_bytes(n))['openapi'] for n in ('collector', "
         "'controlplane')))", str(pyz)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert read.returncode == 0 and read.stdout.split() == ["3.1.0", "3.1.0"], read
    # The documents go in compact: the same JSON as the tree's indented files, in fewer bytes.
    with zipfile.ZipFile(pyz) as archive:
        for name in ("collector", "controlplane"):
            packed = archive.read(f"fleet_min/openapi/{name}.json")
            tree = (pyzs.ROOT / "fleet_min" / "openapi" / f"{name}.json").read_bytes()
            assert json.loads(packed) == json.loads(tree) and len(packed) < 0.7 * len(tree)
    assert pyz.stat().st_size <= 1_500_000, pyz.stat().st_size


def test_each_licence_text_is_stored_once_and_every_package_still_names_its_own(
        pyz: Path) -> None:
    """Several packages ship the same licence file; the archive keeps its text once, and each
    other package's file says where that text is."""
    with zipfile.ZipFile(pyz) as archive:
        licences = {n: archive.read(n) for n in archive.namelist() if n.startswith("licenses/")}
    pointers = {n: t for n, t in licences.items() if t.startswith(b"The same text as ")}
    texts = [t for n, t in licences.items() if n not in pointers]
    assert pointers and len(texts) == len(set(texts)), sorted(pointers)
    for name, text in pointers.items():
        first = text.decode().removeprefix("The same text as ").removesuffix(
            ", in this archive.\n")
        assert first in licences and first not in pointers and first < name, (name, first)
    packages = {n.split("/")[1] for n in licences}
    assert {"aiohttp", "multidict", "yarl", "propcache", "frozenlist", "aiosignal",
            "typing-extensions", "aiohappyeyeballs", "aiosqlite", "pypng"} <= packages


def test_a_second_start_reads_what_the_first_compiled(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION)
    cache = pyzs.folder(home)
    for level in (cache, cache.parent, cache.parent.parent):
        assert stat.S_IMODE(level.stat().st_mode) == 0o700, level
    entry = cache / "fleet_min.cli.pyc"
    assert pyzs.holds_code(entry) and stat.S_IMODE(entry.stat().st_mode) == 0o600
    written = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert {"fleet_min.pyc", "fleet_min.cli.pyc"} <= written.keys()
    assert not [n for n in written if n.endswith(".tmp")]

    assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == written  # nothing rewritten
    # The proof that the second start takes its code from the cache: an entry planted there
    # (valid, ours) is what runs.
    pyzs.plant(cache, "fleet_min.cli", PLANTED)
    assert _started(pyzs.run(pyz, ["--version"], home)) == "planted entry ran\n"


def test_the_collector_runs_from_the_cache(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    for _ in range(2):
        assert "--data" in _started(pyzs.run(pyz, ["collector", "--help"], home))
    names = {p.name for p in pyzs.folder(home).iterdir()}
    assert {"aiohttp.web.pyc", "fleet_min.collector.cli.pyc"} <= names


CORRUPTIONS = {
    "garbage": lambda data: b"\x00not an entry at all",
    "truncated": lambda data: data[: len(data) // 2],
    # Still unmarshals, to code that prints something else: only the CRC tells.
    "a changed byte": lambda data: data.replace(b"planted entry ran", b"planted entry RAN"),
    "another Python's magic number": lambda data: b"\x01\x02\r\n" + data[4:],
    "no code inside": lambda data: pyzs.entry(b"i\x07\x00\x00\x00"),  # marshal of the int 7
}


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_an_entry_that_is_not_whole_is_compiled_again(pyz: Path, tmp_path: Path,
                                                      corruption: str) -> None:
    home = tmp_path / "cache"
    _started(pyzs.run(pyz, ["--version"], home))
    entry = pyzs.plant(pyzs.folder(home), "fleet_min.cli", PLANTED)
    entry.write_bytes(CORRUPTIONS[corruption](entry.read_bytes()))
    assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION)
    assert pyzs.holds_code(entry)  # written again, whole
    assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION)


def _plant_then(pyz: Path, home: Path) -> Path:
    """A cache with a planted entry that would run if the cache were read."""
    _started(pyzs.run(pyz, ["--version"], home))
    cache = pyzs.folder(home)
    pyzs.plant(cache, "fleet_min.cli", PLANTED)
    return cache


def test_a_folder_others_can_write_is_not_used(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    cache = _plant_then(pyz, home)
    for level in (cache, cache.parent, cache.parent.parent):
        level.chmod(0o777)
        assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION), level
        level.chmod(0o700)
    assert _started(pyzs.run(pyz, ["--version"], home)) == "planted entry ran\n"


def test_a_link_in_place_of_the_folder_is_not_followed(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    cache = _plant_then(pyz, home)
    moved = cache.rename(tmp_path / "elsewhere")
    cache.symlink_to(moved)
    assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_cache_another_user_owns_is_not_used(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    cache = _plant_then(pyz, home)
    nobody = 65534
    for owned in (cache / "fleet_min.cli.pyc", cache, cache.parent, cache.parent.parent):
        pyzs.plant(cache, "fleet_min.cli", PLANTED)
        os.chown(owned, nobody, nobody)
        assert _started(pyzs.run(pyz, ["--version"], home)).startswith(VERSION), owned
        os.chown(owned, 0, 0)
    pyzs.plant(cache, "fleet_min.cli", PLANTED)
    assert _started(pyzs.run(pyz, ["--version"], home)) == "planted entry ran\n"


def _read_only(home: Path) -> tuple[str, ...]:
    """A prefix that runs a command with `home` read-only: as root (who writes anywhere) a
    read-only bind mount in a private mount namespace; otherwise the folder's mode."""
    if os.geteuid() != 0:
        home.chmod(0o555)
        return ()
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("root here cannot make a read-only mount (no unshare -m)")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    return ("unshare", "-m", "sh", "-c", script, str(home))


def test_a_read_only_home_starts_from_the_archive(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    home.mkdir()
    prefix = _read_only(home)
    result = pyzs.run(pyz, ["collector", "--help"], home, prefix=prefix)
    assert "--data" in _started(result)
    assert list(home.iterdir()) == []


def test_a_read_only_home_still_reads_its_cache(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    _plant_then(pyz, home)
    prefix = _read_only(home)
    result = pyzs.run(pyz, ["--version"], home, prefix=prefix)
    assert _started(result) == "planted entry ran\n"


def test_python_dash_b_writes_nothing(pyz: Path, tmp_path: Path) -> None:
    home = tmp_path / "cache"
    assert _started(pyzs.run(pyz, ["--version"], home, flags=("-B",))).startswith(VERSION)
    assert [p for p in pyzs.folders(home) if any(p.iterdir())] == []


def _other_pythons() -> list[str]:
    """Other working Pythons 3.11+ here: on PATH, or under pyenv."""
    found = [shutil.which(f"python3.{minor}") or "" for minor in range(11, 20)]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found += [str(p) for p in sorted(pyenv.glob("3.1[1-9].*/bin/python3"))]
    mine, tags, others = Path(sys.executable).resolve(), {sys.implementation.cache_tag}, []
    for python in filter(None, found):
        probe = subprocess.run([python, "-c", "import sys; print(sys.implementation.cache_tag)"],
                               capture_output=True, text=True, timeout=60)
        tag = probe.stdout.strip()
        if probe.returncode == 0 and tag not in tags and Path(python).resolve() != mine:
            tags.add(tag)
            others.append(python)
    return others


def test_each_python_gets_its_own_folder(pyz: Path, tmp_path: Path) -> None:
    others = _other_pythons()
    if not others:
        pytest.skip("only one Python 3.11+ here")
    home = tmp_path / "cache"
    _started(pyzs.run(pyz, ["--version"], home))
    for python in others:
        for _ in range(2):  # the second start reads what the first wrote
            result = subprocess.run([python, "-I", str(pyz), "--version"], capture_output=True,
                                    text=True, timeout=120, env=pyzs.env(home))
            assert _started(result).startswith(VERSION)
    caches = pyzs.folders(home)
    assert len(caches) == 1 + len(others)
    for cache in caches:
        assert (cache / "fleet_min.cli.pyc").is_file()
