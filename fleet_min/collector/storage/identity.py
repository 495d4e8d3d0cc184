"""The collector's stable id: made once, kept in the data directory (`collector-id`), carried by
backups and never overridable. Peers pin it, mDNS advertises it and /api/health shows it, so
what is read back from the file is checked before any of them sees it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fleet_min import filemodes

ID_NAME = "collector-id"
MAX_ID_CHARS = 200


def is_collector_id(text: str) -> bool:
    """One short line of printable text (an id this code makes is `col-` and 16 hex digits)."""
    return 0 < len(text) <= MAX_ID_CHARS and text.isprintable()


class NotAnId(ValueError):
    """A collector-id file that holds no id; `why` says what it is instead, when known (a link,
    a FIFO, too large)."""

    def __init__(self, sentence: str, why: str = "") -> None:
        super().__init__(sentence)
        self.why = why


def read_id(path: Path) -> str | None:
    """The id kept at `path`, None when there is none (no file, or an empty one); ValueError
    with a sentence when the file holds something else (or is a link, a FIFO, a device, or
    longer than an id can be: at most that many bytes are read)."""
    wrong = (f"{path} does not hold a collector id (one line of printable text, at most "
             f"{MAX_ID_CHARS} characters)")
    try:
        raw = filemodes.read_regular(path, MAX_ID_CHARS * 4 + 2)
        text: str | None = raw.decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        text = None  # not an id
    except filemodes.NotRegular as exc:
        why = "it " + str(exc).removeprefix(f"{path} ")
        if exc.what == "large":
            why += ", more than an id can be"
        raise NotAnId(f"{wrong}: {why}", why) from None
    if text == "":
        return None
    if text is None or not is_collector_id(text):
        raise NotAnId(wrong)
    return text


def stable_id(data_dir: Path) -> str:
    """The collector's id, made and kept on the first start. A file that holds something else
    is refused (ValueError), not replaced: peers that pinned the id would see a new collector."""
    path = data_dir / ID_NAME
    existing = read_id(path)
    if existing:
        return existing
    value = "col-" + secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    filemodes.create_file(tmp, filemodes.COLLECTOR_FILE)
    tmp.write_text(value + "\n")
    os.replace(tmp, path)
    return value
