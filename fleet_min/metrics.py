"""Metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Both services serve `GET /metrics` from a `Registry` of families. A family is a counter, a gauge
or a histogram, in one of two kinds:

- instrumented: the service changes it as things happen (`inc`, `set`, `observe`) on the event
  loop's thread, so no lock is taken. An observation is a bisect into a tuple of bounds and two
  additions: cheap enough for the claim path;
- read at scrape: built with `read=`, a function the registry calls while rendering, which
  returns `(label values, value)` pairs (for a histogram: `(label values, observations)`). Most
  gauges are of this kind, so nothing is kept up to date between scrapes.

Rendering never emits NaN (a NaN sample is left out) and escapes label values and help text as
the format asks. Names are checked when a family is made: a wrong one is a programming error.
"""

from __future__ import annotations

import math
import os
import re
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
INF = math.inf

Labels = tuple[str, ...]
Sample = tuple[Labels, float]
ReadValues = Callable[[], Iterable[Sample]]
ReadObservations = Callable[[], Iterable[tuple[Labels, Iterable[float]]]]


# -- text ------------------------------------------------------------------------------------


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as Go's ParseFloat reads it: integers exactly, +Inf/-Inf spelled out."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    value = float(value)
    if value == INF:
        return "+Inf"
    if value == -INF:
        return "-Inf"
    return repr(value)


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{name}="{escape_label(value)}"' for name, value in zip(names, values,
                                                                               strict=True))
    return "{" + pairs + "}"


def _line(name: str, names: Sequence[str], values: Sequence[str], value: float,
          out: list[str]) -> None:
    if value != value:  # NaN: no sample rather than one a reader may take for a real figure
        return
    out.append(f"{name}{_label_text(names, values)} {format_value(value)}")


# -- families --------------------------------------------------------------------------------


class Family(ABC):
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid metric name")
        for label in labels:
            if not _LABEL.fullmatch(label) or label.startswith("__"):
                raise ValueError(f"{label!r} is not a valid label name")
        if len(set(labels)) != len(labels):
            raise ValueError(f"{name}: a label name appears twice")
        self.name = name
        self.help = help_text
        self.labelnames: Labels = tuple(labels)

    def _check(self, values: Sequence[object]) -> Labels:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes {len(self.labelnames)} label values "
                             f"({', '.join(self.labelnames)}), not {len(values)}")
        return tuple(str(v) for v in values)

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        self.samples(out)

    @abstractmethod
    def samples(self, out: list[str]) -> None:
        """Append this family's sample lines (each kind writes its own)."""


class _Value:
    """One labelled series of a counter or gauge."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _Scalar(Family):
    """A counter or gauge: series kept here, or read at scrape by `read`."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 read: ReadValues | None = None) -> None:
        super().__init__(name, help_text, labels)
        self._read = read
        self._series: dict[Labels, _Value] = {}
        if not labels and read is None:
            self._series[()] = _Value()

    def labels(self, *values: object) -> _Value:
        """The series of these label values (made at first use); keep it for hot paths."""
        if self._read is not None:
            raise TypeError(f"{self.name} is read at scrape; it has no series to change")
        key = self._check(values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Value()
        return series

    def samples(self, out: list[str]) -> None:
        if self._read is not None:
            for values, value in self._read():
                _line(self.name, self.labelnames, self._check(values), value, out)
            return
        for values, series in self._series.items():
            _line(self.name, self.labelnames, values, series.value, out)


class Counter(_Scalar):
    """Only goes up (from 0 at start). Prometheus' rate() reads it; by convention its name ends
    in _total."""

    kind = "counter"

    def inc(self, amount: float = 1) -> None:
        """For a counter without labels."""
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.labels().inc(amount)


class Gauge(_Scalar):
    kind = "gauge"

    def set(self, value: float) -> None:
        """For a gauge without labels."""
        self.labels().set(value)


class _Buckets:
    """One labelled series of a histogram: a count per bucket (not cumulative: rendering adds
    them up) with the overflow past the last bound at the end, and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, so a value equal to a bound counts in that
        # bucket (le means "less than or equal").
        if value == value:  # a NaN would poison the sum
            self.counts[bisect_left(self.bounds, value)] += 1
            self.sum += value


class Histogram(Family):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float],
                 labels: Sequence[str] = (), read: ReadObservations | None = None) -> None:
        if "le" in labels:
            raise ValueError("le is the bucket label of a histogram; choose another name")
        super().__init__(name, help_text, labels)
        bounds = tuple(float(b) for b in buckets if b != INF)
        if not bounds or list(bounds) != sorted(set(bounds)) or any(b != b for b in bounds):
            raise ValueError(f"{name}: buckets must be increasing numbers")
        self.bounds = bounds
        self._les = (*(format_value(b) for b in bounds), "+Inf")
        self._read = read
        self._series: dict[Labels, _Buckets] = {}
        if not labels and read is None:
            self._series[()] = _Buckets(bounds)

    def labels(self, *values: object) -> _Buckets:
        if self._read is not None:
            raise TypeError(f"{self.name} is read at scrape; it has no series to change")
        key = self._check(values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Buckets(self.bounds)
        return series

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self._series[()].observe(value)

    def samples(self, out: list[str]) -> None:
        if self._read is not None:
            for values, observations in self._read():
                series = _Buckets(self.bounds)
                for value in observations:
                    series.observe(value)
                self._render_series(self._check(values), series, out)
            return
        for values, series in self._series.items():
            self._render_series(values, series, out)

    def _render_series(self, values: Labels, series: _Buckets, out: list[str]) -> None:
        names = (*self.labelnames, "le")
        running = 0
        for le, count in zip(self._les, series.counts, strict=True):
            running += count
            _line(f"{self.name}_bucket", names, (*values, le), running, out)
        _line(f"{self.name}_sum", self.labelnames, values, series.sum, out)
        _line(f"{self.name}_count", self.labelnames, values, running, out)


# -- registry --------------------------------------------------------------------------------


class Registry:
    """The families a service exposes, rendered in the order they were added."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._taken: set[str] = set()  # every family and sample name in use

    def add(self, family: Family) -> Family:
        names = {family.name, *_sample_names(family)}
        if names & self._taken:
            raise ValueError(f"a metric named {family.name} (or one of its samples) is "
                             "already registered")
        self._taken |= names
        self._families[family.name] = family
        return family

    def counter(self, name: str, help_text: str, labels: Sequence[str] = (),
                read: ReadValues | None = None) -> Counter:
        family = Counter(name, help_text, labels, read)
        self.add(family)
        return family

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = (),
              read: ReadValues | None = None) -> Gauge:
        family = Gauge(name, help_text, labels, read)
        self.add(family)
        return family

    def histogram(self, name: str, help_text: str, buckets: Sequence[float],
                  labels: Sequence[str] = (), read: ReadObservations | None = None
                  ) -> Histogram:
        family = Histogram(name, help_text, buckets, labels, read)
        self.add(family)
        return family

    @property
    def families(self) -> list[Family]:
        return list(self._families.values())

    @property
    def sample_names(self) -> set[str]:
        """The names a query can select: a histogram's _bucket, _sum and _count, the name of
        any other family."""
        return {name for family in self._families.values() for name in _sample_names(family)}

    def render(self) -> str:
        out: list[str] = []
        for family in self._families.values():
            family.render(out)
        out.append("")
        return "\n".join(out)


def _sample_names(family: Family) -> set[str]:
    if isinstance(family, Histogram):
        return {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    return {family.name}


# -- the process -------------------------------------------------------------------------------


def resident_bytes() -> float | None:
    """Resident memory now, from /proc/self/statm (Linux); None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def open_fds() -> int | None:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            # The listing itself holds one descriptor open while it reads.
            return max(0, len(os.listdir(folder)) - 1)
        except OSError:
            continue
    return None


def add_process(registry: Registry, started_at: float) -> None:
    """The usual process_* families: start time, CPU, resident memory, open descriptors, and
    the descriptor limit."""
    registry.gauge("process_start_time_seconds",
                   "When the process started, in seconds since the Unix epoch.",
                   read=lambda: [((), started_at)])
    registry.counter("process_cpu_seconds_total", "User and system CPU time the process used.",
                     read=lambda: [((), _cpu_seconds())])
    registry.gauge("process_resident_memory_bytes", "Resident memory (from /proc/self/statm).",
                   read=lambda: present(resident_bytes()))
    registry.gauge("process_open_fds", "Open file descriptors.",
                   read=lambda: present(open_fds()))
    registry.gauge("process_max_fds", "The soft limit on open file descriptors.",
                   read=lambda: present(_fd_limit()))


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _fd_limit() -> float | None:
    try:
        import resource  # Unix only
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def present(value: float | None) -> list[Sample]:
    """The one sample of an unlabelled figure, or none when it is unknown."""
    return [] if value is None else [((), value)]
