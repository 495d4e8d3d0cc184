"""Runner and job labels as the control plane keeps them, wherever they come from (an agent's
heartbeat, GitHub's answers): one rule, so labels compared across sources are cut alike."""

from __future__ import annotations

from typing import Any

from fleet_min.validate import is_label

MAX_LABELS = 50  # looked at, in order; GitHub's runners and jobs carry a handful
LABEL_CHARS = 100  # each label is cut to this (GitHub's own are far shorter)
MAX_LABEL_CHARS = 1000  # all labels together (an agent's own are a few dozen)


def fit_labels(labels: Any) -> list[str]:
    """The labels, in order, while they fit MAX_LABEL_CHARS (each cut to LABEL_CHARS); only
    the first MAX_LABELS are looked at, and one that is not a string or holds a control or
    reordering character is skipped. Every snapshot lists them for each runner and each job in
    flight, so their size must not be the sender's to choose."""
    out: list[str] = []
    size = 0
    for label in labels[:MAX_LABELS] if isinstance(labels, list) else []:
        if isinstance(label, str) and is_label(label):
            size += len(label[:LABEL_CHARS])
            if size > MAX_LABEL_CHARS:
                break
            out.append(label[:LABEL_CHARS])
    return out
