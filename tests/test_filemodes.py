"""Reading a small file someone else may have put in place (`filemodes.read_regular`): the one
way the collector's id, a backup's manifest, the control plane's tokens and a runner's files are
read. Real files, FIFOs, links and devices on this machine's file system."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from fleet_min import filemodes


def test_a_regular_file_within_its_cap_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "id"
    path.write_bytes(b"col-0123\n")
    assert filemodes.read_regular(path, 9) == b"col-0123\n"
    with pytest.raises(filemodes.NotRegular) as caught:
        filemodes.read_regular(path, 8)
    assert caught.value.what == "large" and str(caught.value) == f"{path} is larger than 8 bytes"
    assert filemodes.read_regular(path, 3, truncate=True) == b"col"


def test_a_sparse_gigabyte_is_refused_or_cut_without_being_read(tmp_path: Path) -> None:
    path = tmp_path / "huge"
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)
    with pytest.raises(filemodes.NotRegular, match="larger than 100 bytes"):
        filemodes.read_regular(path, 100)
    assert filemodes.read_regular(path, 100, truncate=True) == bytes(100)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(filemodes.read_regular(path, 10))
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "read_regular waited on a FIFO"
    assert isinstance(outcome[0], filemodes.NotRegular) and outcome[0].what == "special"


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_or_a_folder_is_refused(tmp_path: Path, device: str) -> None:
    for path in (Path(device), tmp_path):
        with pytest.raises(filemodes.NotRegular) as caught:
            filemodes.read_regular(path, 10)
        assert caught.value.what == "special", path


def test_a_link_is_refused_unless_followed_on_purpose(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(filemodes.NotRegular) as caught:
        filemodes.read_regular(link, 10)
    assert caught.value.what == "link" and "never read through one" in str(caught.value)
    assert filemodes.read_regular(link, 10, follow=True) == b"secret"
    # Followed or not, a link to a device stays refused.
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(filemodes.NotRegular) as caught:
        filemodes.read_regular(tmp_path / "zero", 10, follow=True)
    assert caught.value.what == "special"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(filemodes.NotRegular):
        filemodes.read_regular(loop, 10, follow=True)


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        filemodes.read_regular(tmp_path / "none", 10)


def test_open_regular_hands_back_the_stat_of_what_it_opened(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    fd, st = filemodes.open_regular(path)
    try:
        assert st.st_size == 3 and os.read(fd, 10) == b"abc"
        assert os.fstat(fd).st_ino == path.stat().st_ino
    finally:
        os.close(fd)
