"""Five-field cron expressions: parse one, ask whether a minute is due, find the next due minute.

Pure functions of an expression, an epoch time and a time zone (None = the host's local time);
nothing here reads the clock. The grammar is the crontab(5) one people already know:

    minute hour day-of-month month day-of-week
    *  5  1-5  */15  10-40/10  1,15,30  jan-mar  mon-fri  7 (= sunday)

plus the aliases @yearly (@annually), @monthly, @weekly, @daily (@midnight) and @hourly.

Day-of-month and day-of-week follow the classic Vixie cron rule: when both fields are restricted
the day matches if EITHER matches ("0 9 1 * mon" runs on the 1st and on every Monday); a field
that begins with `*` (including `*/2`) counts as unrestricted, and then both must match.

Daylight-saving time, as Vixie cron does it: a job with a fixed minute and hour whose wall time
falls into a skipped hour runs at the first minute after the jump; in a repeated hour it runs on
the first pass only. Jobs with `*` in the minute or hour field simply follow the wall clock.
"""

from __future__ import annotations

import bisect
import calendar
import math
from dataclasses import dataclass
from datetime import date, datetime, timedelta, tzinfo
from functools import lru_cache

MAX_LENGTH = 200  # longer text is refused before parsing (nothing to gain, something to abuse)
MAX_PARTS = 60    # comma-separated parts in one field

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")

# A valid expression always matches within 8 years (Feb 29 across a century year); past this
# horizon next_after gives up with an error instead of looping.
_HORIZON_S = 9 * 366 * 86400
_HORIZON_MONTHS = 9 * 12 + 2  # months _next_day looks through: past the horizon in any zone
_MINUTE = timedelta(minutes=1)


class CronError(ValueError):
    """An expression that cannot be used, with a sentence naming the field at fault."""


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    names_from: int = 0  # the value of names[0]


_FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day-of-month", 1, 31),
    _Field("month", 1, 12, MONTHS, 1),
    _Field("day-of-week", 0, 7, WEEKDAYS, 0),
)


@dataclass(frozen=True)
class Cron:
    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]       # 1..31
    months: frozenset[int]     # 1..12
    weekdays: frozenset[int]   # 0..6, 0 = sunday
    dom_star: bool             # the day-of-month field began with *
    dow_star: bool
    fixed_time: bool           # neither minute nor hour began with * (DST rules above)

    # -- matching a wall-clock minute -------------------------------------------------------

    def _day_matches(self, wall: datetime) -> bool:
        dom = wall.day in self.days
        dow = wall.isoweekday() % 7 in self.weekdays
        if self.dom_star or self.dow_star:
            return dom and dow
        return dom or dow

    def matches_wall(self, wall: datetime) -> bool:
        """Does this wall-clock minute (a naive local datetime) match every field?"""
        return (wall.month in self.months and wall.hour in self.hours
                and wall.minute in self.minutes and self._day_matches(wall))

    # -- due minutes in real time -----------------------------------------------------------

    def is_due(self, ts: float, tz: tzinfo | None = None) -> bool:
        """Is the minute holding epoch time `ts` a due minute in time zone `tz`?"""
        t = math.floor(ts / 60) * 60
        wall = _wall(t, tz)
        if self.matches_wall(wall):
            return not (wall.fold and self.fixed_time)  # a repeated hour: first pass only
        if not self.fixed_time:
            return False
        before = _wall(t - 60, tz)
        if wall - before <= _MINUTE:
            return False
        # The clocks jumped forward: a fixed-time job in the skipped stretch runs now.
        skipped = before.replace(fold=0) + _MINUTE
        while skipped < wall.replace(fold=0):
            if self.matches_wall(skipped):
                return True
            skipped += _MINUTE
        return False

    def next_after(self, ts: float, tz: tzinfo | None = None) -> float:
        """The first due minute (epoch seconds, on a minute boundary) strictly after `ts`."""
        t = (math.floor(ts / 60) + 1) * 60
        end = t + _HORIZON_S
        while t < end:
            if self.is_due(t, tz):
                return float(t)
            t = self._skip(t, tz)
        raise CronError(f"cron {self.text!r} has no due minute in the next nine years")

    def _skip(self, t: int, tz: tzinfo | None) -> int:
        """A later candidate minute, jumping over wall time that cannot match."""
        wall = _wall(t, tz)
        target = self._next_candidate(wall.replace(fold=0))
        step = t + int((target - wall.replace(fold=0)).total_seconds())
        landed = _wall(step, tz).replace(fold=0)
        if landed > target:  # a jump forward in between: step back to the wall time wanted
            step -= int((landed - target).total_seconds())
        step = step if step > t else t + 60
        if not self.fixed_time:
            # Wall minutes already passed come round again once the clocks go back; a wildcard
            # job follows the wall clock, so the second pass must be looked at too.
            repeat = _repeat_starts(t, wall, tz)
            if repeat is not None and repeat < step:
                return repeat
        return step

    def _next_candidate(self, wall: datetime) -> datetime:
        """The next wall minute after `wall` that is not ruled out by a coarser field."""
        if wall.month not in self.months or not self._day_matches(wall):
            return self._next_day(wall.date() + timedelta(days=1))
        midnight = wall.replace(hour=0, minute=0, second=0, microsecond=0)
        later_hours = [h for h in self.hours if h > wall.hour]
        if wall.hour not in self.hours:
            return (midnight.replace(hour=min(later_hours)) if later_hours
                    else self._next_day(wall.date() + timedelta(days=1)))
        later_minutes = [m for m in self.minutes if m > wall.minute]
        if later_minutes:
            return wall.replace(minute=min(later_minutes), second=0, microsecond=0)
        return wall.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)

    def _next_day(self, start: date) -> datetime:
        """Midnight of the first day on or after `start` whose month and day match, found by
        calendar arithmetic a month at a time: a rare date ('0 0 29 2 */7', 29 February on a
        Sunday) costs a look-up per month, not a time-zone conversion per day. Past the
        horizon it answers a day beyond it, where next_after stops."""
        year, month, day = start.year, start.month, start.day
        for _ in range(_HORIZON_MONTHS):
            if month in self.months:
                first_weekday, length = calendar.monthrange(year, month)
                days = _month_days(self, (first_weekday + 1) % 7, length)
                later = days[bisect.bisect_left(days, day):]
                if later:
                    return datetime(year, month, later[0])
            year, month, day = year + month // 12, month % 12 + 1, 1
        return datetime(min(year, 9998), month, 1)


@lru_cache(maxsize=32768)  # 28 month shapes for each of a collector's 1,000 schedules
def _month_days(cron: Cron, first_weekday: int, length: int) -> tuple[int, ...]:
    """The days of a month of `length` days starting on `first_weekday` (0 = sunday) that the
    day-of-month and day-of-week fields match: 28 month shapes, so at most 28 entries a cron."""
    def matches(day: int) -> bool:
        dom = day in cron.days
        dow = (first_weekday + day - 1) % 7 in cron.weekdays
        return dom and dow if cron.dom_star or cron.dow_star else dom or dow
    return tuple(day for day in range(1, length + 1) if matches(day))


_EPOCH = datetime(1970, 1, 1)
_LONGEST_SETBACK_S = 3 * 3600  # clocks have gone back by two hours at most (double summer time)


def _offset(t: int, wall: datetime) -> int:
    """Seconds the wall clock is ahead of UTC at `t` (`wall` is its wall time)."""
    return int((wall.replace(fold=0) - _EPOCH).total_seconds()) - t


def _repeat_starts(t: int, wall: datetime, tz: tzinfo | None) -> int | None:
    """When `t` lies in the first pass of wall time that repeats (the clocks go back within
    the next stretch of that length), the first minute of the second pass; else None. One
    conversion when there is no such transition ahead, a few more around one."""
    offset = _offset(t, wall)
    probe = t + _LONGEST_SETBACK_S
    setback = offset - _offset(probe, _wall(probe, tz))
    if setback <= 0 or _offset(t + setback, _wall(t + setback, tz)) >= offset:
        return None  # no setback ahead, or `t` is before the stretch that repeats
    low, high = t, t - -setback // 60 * 60  # the offset drops in (low, high]: find the minute
    while high - low > 60:
        middle = low + (high - low) // 120 * 60
        if _offset(middle, _wall(middle, tz)) < offset:
            high = middle
        else:
            low = middle
    return high


def _wall(t: float, tz: tzinfo | None) -> datetime:
    """Epoch seconds as a naive wall-clock datetime in tz (None = local), fold set (PEP 495)."""
    if tz is None:
        return datetime.fromtimestamp(t)
    return datetime.fromtimestamp(t, tz).replace(tzinfo=None)


# ---------------------------------------------------------------------------------------------
# parsing


def parse(text: str) -> Cron:
    """Parse an expression or raise CronError with a sentence naming the field."""
    # Checked before the cache: a dict or a list is not hashable and would crash lru_cache.
    if not isinstance(text, str):
        raise CronError("cron must be a string such as '*/15 * * * *'")
    return _parse(text)


@lru_cache(maxsize=512)
def _parse(text: str) -> Cron:
    if len(text) > MAX_LENGTH:
        raise CronError(f"cron is longer than {MAX_LENGTH} characters")
    source = text.strip()
    if source.startswith("@"):
        expanded = ALIASES.get(source.lower())
        if expanded is None:
            raise CronError(f"cron alias {source[:20]!r} is unknown; use one of "
                            f"{', '.join(ALIASES)}")
        source = expanded
    parts = source.split()
    if len(parts) != 5:
        raise CronError(f"cron needs 5 fields (minute hour day-of-month month day-of-week), "
                        f"got {len(parts)}; for example '30 6 * * mon-fri'")
    values = [_parse_field(part, spec) for part, spec in zip(parts, _FIELDS, strict=True)]
    minutes, hours, days, months, weekdays = values
    weekdays = frozenset(d % 7 for d in weekdays)
    cron = Cron(text=text.strip(), minutes=minutes, hours=hours, days=days, months=months,
                weekdays=weekdays, dom_star=parts[2].startswith("*"),
                dow_star=parts[4].startswith("*"),
                fixed_time=not (parts[0].startswith("*") or parts[1].startswith("*")))
    _check_reachable(cron)
    return cron


def _parse_field(text: str, spec: _Field) -> frozenset[int]:
    items = text.split(",")
    if len(items) > MAX_PARTS:
        raise CronError(f"cron {spec.name}: more than {MAX_PARTS} comma-separated parts")
    values: set[int] = set()
    for item in items:
        values.update(_parse_item(item, spec))
    return frozenset(values)


def _parse_item(item: str, spec: _Field) -> range:
    if not item:
        raise CronError(f"cron {spec.name}: an empty part (two commas in a row, or a "
                        "trailing comma)")
    body, slash, step_text = item.partition("/")
    step = _parse_step(step_text, spec) if slash else 1
    if body == "*":
        low, high = spec.low, spec.high
    elif "-" in body:
        first, _, last = body.partition("-")
        low, high = _parse_value(first, spec), _parse_value(last, spec)
        if low > high:
            raise CronError(f"cron {spec.name}: the range {body!r} runs backwards; write it "
                            f"as two parts, e.g. '{first}-{spec.high},{spec.low}-{last}'")
    else:
        low = _parse_value(body, spec)
        high = spec.high if slash else low  # '5/15' means 5-max/15, as most crons read it
    return range(low, high + 1, step)


def _is_number(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and '٣'."""
    return text.isascii() and text.isdigit()


def _parse_step(text: str, spec: _Field) -> int:
    span = spec.high - spec.low + 1
    if not _is_number(text) or not 1 <= int(text) <= span:
        raise CronError(f"cron {spec.name}: the step after '/' must be a whole number from 1 "
                        f"to {span}, got {text[:10]!r}")
    return int(text)


def _parse_value(text: str, spec: _Field) -> int:
    lowered = text.lower()
    if spec.names and lowered in spec.names:
        return spec.names.index(lowered) + spec.names_from
    if _is_number(text) and len(text) <= 4:
        value = int(text)
        if spec.low <= value <= spec.high:
            return value
        extra = " (0 and 7 are sunday)" if spec.name == "day-of-week" else ""
        raise CronError(f"cron {spec.name}: {value} is out of range {spec.low}-{spec.high}"
                        f"{extra}")
    named = f" or a name ({spec.names[0]}..{spec.names[-1]})" if spec.names else ""
    raise CronError(f"cron {spec.name}: {text[:20]!r} is not a number from {spec.low} to "
                    f"{spec.high}{named}")


def _check_reachable(cron: Cron) -> None:
    """Refuse a day-of-month/month pair that no calendar has, e.g. '0 0 31 feb *'."""
    if cron.dom_star or not cron.dow_star:
        return  # day-of-week alone (or OR-ed in) always comes round
    longest = {m: calendar.monthrange(2024, m)[1] for m in range(1, 13)}  # 2024: a leap year
    if not any(day <= longest[month] for month in cron.months for day in cron.days):
        raise CronError(f"cron day-of-month: no month chosen has day {min(cron.days)}, so "
                        "the schedule would never run")
