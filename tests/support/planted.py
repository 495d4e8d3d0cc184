"""A symbolic link planted in a service's loose directory, and what must hold once the service
refused it: the link's target untouched, or (for one that did not exist) still not made."""

from __future__ import annotations

from pathlib import Path


def plant_link(directory: Path, name: str, elsewhere: Path, victim_name: str,
               dangling: bool) -> Path:
    """`directory/name` made a link to `elsewhere/victim_name`, a file holding "precious" unless
    `dangling` (then the link points at nothing yet); the victim's path."""
    elsewhere.mkdir()
    victim = elsewhere / victim_name
    if not dangling:
        victim.write_text("precious\n")
    (directory / name).symlink_to(victim)
    return victim


def assert_refused_untouched(stderr: str, name: str, victim: Path, dangling: bool) -> None:
    assert f"{name} is a symbolic link" in stderr and "remove the link" in stderr, stderr
    if dangling:
        assert list(victim.parent.iterdir()) == []
    else:
        assert victim.read_text() == "precious\n"
