"""How fleet.pyz starts: zipapp.py makes this file the archive's `__main__.py`, with BUILD_ID set
to a digest of everything else in the archive.

The archive carries sources and no bytecode. A `.pyc` suits one Python version only, and the
Pythons that run fleet.pyz differ (3.11 on Raspberry Pi OS Bookworm, 3.13 on Trixie): bytecode
inside the archive helped one of them and the others compiled every module on every start. So
each module is compiled from the archive once, on its first import, and its code kept in a
cache folder of this user's, one per build and per Python:

    <cache>/fleet-min/<BUILD_ID>/<cache tag>[-opt<N>]/<module name>.pyc

where <cache> is $CACHE_DIRECTORY (what systemd's CacheDirectory= sets), else $XDG_CACHE_HOME,
else ~/.cache. Later starts read the code from there. The cache only ever speeds a start up:

- each of the three folders is created 0700 and used only if it is a real folder (not a link)
  owned by this user that nobody else can write to. The check is made on an open descriptor of
  the folder, and every read and write goes through that descriptor, so a folder swapped in
  after the check is never consulted.
- an entry is `MAGIC_NUMBER, CRC-32, length, marshalled code`; it is used only if it is a
  regular file owned by this user whose magic number, length and CRC-32 match and whose bytes
  unmarshal to a code object. Anything else is compiled again from the archive and rewritten.
- entries are written under a temporary name and renamed into place: a reader sees a whole entry
  or none, also while another start writes the same one.
- a folder that cannot be created or opened (a read-only home, no home at all) means no cache: the
  modules are compiled from the archive, as without one. A failed write stops the writing for
  the rest of the run; `python -B` (or PYTHONDONTWRITEBYTECODE) reads the cache but never writes.

A folder per build is never removed by fleet.pyz; deleting the cache at any time is safe.
"""

from __future__ import annotations

import _thread
import contextlib
import marshal
import os
import stat
import sys
import zipimport
import zlib
from importlib.util import MAGIC_NUMBER
from types import CodeType

BUILD_ID = ""  # zipapp.py writes the archive's digest here

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
_HEADER = len(MAGIC_NUMBER) + 8  # the magic number, then CRC-32 and length, 4 bytes each


def encode(code: CodeType) -> bytes:
    """A cache entry: this Python's magic number, CRC-32 and length of the code, the code."""
    payload = marshal.dumps(code)
    return (MAGIC_NUMBER + zlib.crc32(payload).to_bytes(4, "little")
            + len(payload).to_bytes(4, "little") + payload)


def decode(data: bytes) -> CodeType | None:
    """The code in a cache entry, or None when the entry is not whole and ours."""
    view = memoryview(data)
    if len(data) < _HEADER or view[:len(MAGIC_NUMBER)] != MAGIC_NUMBER:
        return None
    crc = int.from_bytes(view[_HEADER - 8:_HEADER - 4], "little")
    size = int.from_bytes(view[_HEADER - 4:_HEADER], "little")
    payload = view[_HEADER:]
    if len(payload) != size or zlib.crc32(payload) != crc:
        return None
    try:
        # Only our own entries get here: owned by this user, in a folder no one else can
        # write to, whole by their CRC.
        code = marshal.loads(payload)  # noqa: S302
    except (EOFError, ValueError, TypeError):
        return None
    return code if isinstance(code, CodeType) else None


class CodeCache:
    """The compiled modules of one build for this Python, in a folder held open by descriptor."""

    def __init__(self, dir_fd: int, writable: bool) -> None:
        self.dir_fd = dir_fd
        self.writable = writable
        self._serial = 0

    def load(self, name: str) -> CodeType | None:
        try:
            fd = os.open(name + ".pyc", os.O_RDONLY | _NOFOLLOW, dir_fd=self.dir_fd)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                return None
            data = os.read(fd, info.st_size + 1)  # a short read fails the length check
        except OSError:
            return None
        finally:
            os.close(fd)
        return decode(data)

    def store(self, name: str, code: CodeType) -> None:
        if not self.writable:
            return
        self._serial += 1
        temporary = f".{name}.{os.getpid()}.{_thread.get_ident()}.{self._serial}.tmp"
        data = encode(code)
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600,
                         dir_fd=self.dir_fd)
            try:
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
            finally:
                os.close(fd)
            # POSIX rename replaces the old entry atomically.
            os.rename(temporary, name + ".pyc", src_dir_fd=self.dir_fd,
                      dst_dir_fd=self.dir_fd)
        except OSError:
            self.writable = False  # full, read-only, gone: the rest of this run compiles only
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=self.dir_fd)


def cache_root() -> str | None:
    """The folder the per-build folders go under, when there is an absolute one."""
    for variable in ("CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        value = os.environ.get(variable, "").split(":")[0]
        if os.path.isabs(value):
            return value
    home = os.path.expanduser("~")
    return os.path.join(home, ".cache") if os.path.isabs(home) else None


def _private_child(parent_fd: int, name: str) -> int | None:
    """An open descriptor of parent/name (made 0700 if missing), if it is a real folder owned by
    this user that no one else can write to; None otherwise."""
    # There already, or cannot be made (read-only): opening it says which.
    with contextlib.suppress(OSError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, _DIRECTORY, dir_fd=parent_fd)
    except OSError:
        return None
    info = os.fstat(fd)
    if (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
            and not info.st_mode & 0o022):
        return fd
    os.close(fd)
    return None


_DIR_FD_CALLS = (os.open, os.mkdir, os.rename, os.unlink)


def open_cache(build_id: str) -> CodeCache | None:
    """This build's cache for this Python, or None when there can be none."""
    tag = sys.implementation.cache_tag
    root = cache_root()
    if (not build_id or tag is None or root is None
            or not all(call in os.supports_dir_fd for call in _DIR_FD_CALLS)):
        return None
    if sys.flags.optimize:
        tag += f"-opt{sys.flags.optimize}"
    try:
        os.makedirs(root, 0o700, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # may be a link
    except OSError:
        return None
    for name in ("fleet-min", build_id, tag):
        child = _private_child(fd, name)
        os.close(fd)
        if child is None:
            return None
        fd = child
    return CodeCache(fd, writable=not sys.dont_write_bytecode)


class CachedZipImporter(zipimport.zipimporter):
    """zipimport that compiles a module once, not twice, and keeps its code in the cache."""

    cache: CodeCache | None = None

    def get_filename(self, fullname: str) -> str:
        # zipimport's own learns the name by loading the module's code, and every import asks
        # for it (to make the module's spec) before loading the code again to run it: without
        # bytecode in the archive, that was two compiles of each module. The archive holds
        # sources only, so the name is the source's.
        tail = os.sep + "__init__.py" if self.is_package(fullname) else ".py"
        return f"{self.archive}{os.sep}{self.prefix}{fullname.rpartition('.')[2]}{tail}"

    def get_code(self, fullname: str) -> CodeType:
        # Only names that are dotted identifiers become file names in the cache.
        cache = self.cache if all(p.isidentifier() for p in fullname.split(".")) else None
        code = cache.load(fullname) if cache is not None else None
        if code is None:
            code = super().get_code(fullname)
            if cache is not None:
                cache.store(fullname, code)
        return code


def install(archive: str, cache: CodeCache | None) -> None:
    """Import the archive's modules through CachedZipImporter from now on."""
    inside = archive + os.sep

    def hook(path: str) -> zipimport.zipimporter:
        if path != archive and not path.startswith(inside):
            raise ImportError("not inside fleet.pyz")
        importer = CachedZipImporter(path)
        importer.cache = cache
        return importer

    sys.path_hooks.insert(0, hook)
    for path in [p for p in sys.path_importer_cache if p == archive or p.startswith(inside)]:
        del sys.path_importer_cache[path]


def run(loader: object) -> int:
    archive = getattr(loader, "archive", None)
    if isinstance(archive, str):
        install(archive, open_cache(BUILD_ID))
    from fleet_min.cli import main

    return main()


if __name__ == "__main__":
    if sys.version_info < (3, 11):  # noqa: UP036 (older Pythons run this file too)
        sys.exit("fleet.pyz needs Python 3.11 or newer")
    sys.exit(run(globals().get("__loader__")))
