"""Whether a device satisfies a job's match expression, remembered, and the time one request may
spend finding out.

A match expression's regular expressions are checked so that one evaluation stays short
(match.py: at most about 2 ms on a 256-character value), but a claim reads every queued job it
may be offered, and a fan-out or a preview every registered device. With thousands of queued
jobs whose expression this device fails, each poll evaluated all of them again (5,000 of them
held the event loop 11 s on one poll); a fan-out over 6,000 devices took 15 s.

So a verdict is kept per (expression, device as it registered): a device registering anew (a
new descriptor, pools or capabilities) is a new device here, and the same expression on many
jobs, the usual flood, is evaluated once per device. And each request has a budget of evaluation
time: a claim past it stops evaluating for this poll (the jobs not yet judged count as refused
this time; their verdicts so far are kept, so the next poll judges the next ones), and a fan-out
or a preview past it is refused with a sentence.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from fleet_min.collector.jobs.devices import Device
from fleet_min.collector.jobs.match import compiled

CLAIM_BUDGET_S = 0.02  # evaluation time one claim may spend on expressions it has not judged
# The same for one fan-out or preview, over every registered device: 25,000 devices (the
# registry's bound) at the few microseconds a plain expression takes on a short value fit.
TARGETS_BUDGET_S = 0.25
KEPT = 65_536  # verdicts remembered: two small integers and a bool each


class Budget:
    """Evaluation time left to one request; `spent` once it ran out."""

    __slots__ = ("left", "spent")

    def __init__(self, seconds: float) -> None:
        self.left = seconds
        self.spent = False


# (hash of the expression, the device's fingerprint) -> verdict. Hashes, not the texts: an
# expression may be 1,000 characters and a descriptor 16 KiB, and the table keeps 65,536.
# Python's string hash is keyed per process, so nobody can aim two texts at one entry.
_VERDICTS: OrderedDict[tuple[int, int], bool] = OrderedDict()


def satisfies(device: Device, expression: str, budget: Budget | None) -> bool | None:
    """Whether `device` satisfies `expression`; None when it has not been judged and the budget
    is spent (`budget.spent` is then set)."""
    key = (hash(expression), device.fingerprint)
    verdict = _VERDICTS.get(key)
    if verdict is not None:
        return verdict
    if budget is not None and budget.left <= 0:
        budget.spent = True
        return None
    started = time.perf_counter()
    verdict = compiled(expression).evaluate(device.view())
    if budget is not None:
        budget.left -= time.perf_counter() - started
    _VERDICTS[key] = verdict
    if len(_VERDICTS) > KEPT:
        _VERDICTS.popitem(last=False)
    return verdict

