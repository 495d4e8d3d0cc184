"""Cron expressions: the grammar, the day-of-month/day-of-week rule, next_after, DST."""

from __future__ import annotations

from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_min.cron import CronError, parse

BERLIN = ZoneInfo("Europe/Berlin")


def ts(*args: int, tz=UTC) -> float:
    return datetime(*args, tzinfo=tz).timestamp()


def at(value: float, tz=UTC) -> datetime:
    return datetime.fromtimestamp(value, tz).replace(tzinfo=None)


def runs(expr: str, start: float, count: int, tz=UTC) -> list[datetime]:
    cron, out, t = parse(expr), [], start
    for _ in range(count):
        t = cron.next_after(t, tz)
        out.append(at(t, tz))
    return out


# -- grammar -----------------------------------------------------------------------------------


def test_lists_ranges_and_steps():
    cron = parse("0,30 9-17/2 */10 1-12/3 *")
    assert cron.minutes == {0, 30}
    assert cron.hours == {9, 11, 13, 15, 17}
    assert cron.days == {1, 11, 21, 31}
    assert cron.months == {1, 4, 7, 10}


def test_a_start_with_a_step_runs_to_the_end_of_the_field():
    assert parse("5/20 * * * *").minutes == {5, 25, 45}


def test_month_and_day_names_in_any_case_and_in_ranges():
    cron = parse("0 0 * JAN-mar,Dec Mon-Fri")
    assert cron.months == {1, 2, 3, 12}
    assert cron.weekdays == {1, 2, 3, 4, 5}


def test_seven_is_sunday_too():
    assert parse("0 0 * * 7").weekdays == {0}
    assert parse("0 0 * * 5-7").weekdays == {5, 6, 0}
    assert parse("0 0 * * sun").weekdays == {0}


@pytest.mark.parametrize(("alias", "expanded"), [
    ("@yearly", "0 0 1 1 *"), ("@annually", "0 0 1 1 *"), ("@monthly", "0 0 1 * *"),
    ("@weekly", "0 0 * * 0"), ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"),
    ("@hourly", "0 * * * *"),
])
def test_aliases(alias, expanded):
    a, b = parse(alias), parse(expanded)
    assert (a.minutes, a.hours, a.days, a.months, a.weekdays) == (
        b.minutes, b.hours, b.days, b.months, b.weekdays)


@pytest.mark.parametrize(("expr", "words"), [
    ("* * * *", "needs 5 fields"),
    ("* * * * * *", "needs 5 fields"),
    ("60 * * * *", "minute: 60 is out of range 0-59"),
    ("* 24 * * *", "hour: 24 is out of range 0-23"),
    ("* * 0 * *", "day-of-month: 0 is out of range 1-31"),
    ("* * * 13 *", "month: 13 is out of range 1-12"),
    ("* * * * 8", "day-of-week: 8 is out of range 0-7 (0 and 7 are sunday)"),
    ("* * * foo *", "month: 'foo' is not a number from 1 to 12 or a name (jan..dec)"),
    ("mon * * * *", "minute: 'mon' is not a number"),
    ("*/0 * * * *", "minute: the step after '/' must be a whole number from 1 to 60"),
    ("*/x * * * *", "minute: the step"),
    ("* 5-1 * * *", "hour: the range '5-1' runs backwards"),
    ("* * * * fri-mon", "day-of-week: the range 'fri-mon' runs backwards"),
    ("1,,2 * * * *", "minute: an empty part"),
    ("0 0 30 feb *", "day-of-month: no month chosen has day 30"),
    ("@reboot", "alias '@reboot' is unknown"),
    ("-1 * * * *", "minute"),
    ("1-2-3 * * * *", "minute"),
    ("* " * 150, "longer than 200"),
])
def test_errors_name_the_field(expr, words):
    with pytest.raises(CronError) as raised:
        parse(expr)
    assert words in str(raised.value)


def test_feb_31_with_a_weekday_is_fine_because_the_weekday_comes_round():
    parse("0 0 31 2 mon")  # the OR rule: every Monday in February


# -- next_after --------------------------------------------------------------------------------


def test_next_after_is_strictly_later_and_on_a_minute():
    start = ts(2026, 5, 1, 10, 0, 0)
    assert runs("* * * * *", start, 2) == [datetime(2026, 5, 1, 10, 1),
                                            datetime(2026, 5, 1, 10, 2)]
    assert runs("* * * * *", start + 59.9, 1) == [datetime(2026, 5, 1, 10, 1)]


def test_every_fifteen_minutes_across_an_hour():
    assert runs("*/15 * * * *", ts(2026, 5, 1, 10, 40), 3) == [
        datetime(2026, 5, 1, 10, 45), datetime(2026, 5, 1, 11, 0), datetime(2026, 5, 1, 11, 15)]


def test_month_ends_and_leap_days():
    assert runs("0 12 31 * *", ts(2026, 1, 31, 13), 3) == [
        datetime(2026, 3, 31, 12), datetime(2026, 5, 31, 12), datetime(2026, 7, 31, 12)]
    assert runs("0 0 29 2 *", ts(2026, 1, 1), 2) == [datetime(2028, 2, 29),
                                                     datetime(2032, 2, 29)]
    # 2100 is not a leap year: eight years between Feb 29ths, still found.
    assert runs("0 0 29 2 *", ts(2097, 1, 1), 1) == [datetime(2104, 2, 29)]


def test_weekdays_only():
    # 2026-05-01 is a Friday.
    assert runs("30 6 * * mon-fri", ts(2026, 5, 1, 7), 2) == [
        datetime(2026, 5, 4, 6, 30), datetime(2026, 5, 5, 6, 30)]


def test_day_of_month_or_day_of_week_when_both_are_restricted():
    # The 13th, or any Friday (2026-05-01 is a Friday, 2026-05-13 a Wednesday).
    assert runs("0 0 13 * fri", ts(2026, 4, 30), 4) == [
        datetime(2026, 5, 1), datetime(2026, 5, 8), datetime(2026, 5, 13), datetime(2026, 5, 15)]


def test_a_starred_day_field_means_both_must_match():
    # "*/2" starts with * so it counts as unrestricted: odd days that are also Fridays.
    assert runs("0 0 */2 * fri", ts(2026, 4, 30), 3) == [
        datetime(2026, 5, 1), datetime(2026, 5, 15), datetime(2026, 5, 29)]


def test_yearly_and_monthly():
    assert runs("@yearly", ts(2026, 5, 1), 1) == [datetime(2027, 1, 1)]
    assert runs("@monthly", ts(2026, 12, 15), 1) == [datetime(2027, 1, 1)]
    assert runs("@weekly", ts(2026, 5, 1), 1) == [datetime(2026, 5, 3)]  # a Sunday


def test_is_due_matches_the_minute_not_the_second():
    cron = parse("30 6 * * *")
    assert cron.is_due(ts(2026, 5, 1, 6, 30, 59), UTC)
    assert not cron.is_due(ts(2026, 5, 1, 6, 31), UTC)


def test_local_time_is_the_default_zone():
    cron, start = parse("17 * * * *"), ts(2026, 5, 1, 10)
    local = datetime.fromtimestamp(cron.next_after(start))
    assert local.minute == 17


# -- daylight saving time (Europe/Berlin: 2026-03-29 02:00 -> 03:00, 2026-10-25 03:00 -> 02:00)


def test_a_fixed_time_in_the_skipped_hour_runs_right_after_the_jump():
    assert runs("30 2 * * *", ts(2026, 3, 28, 12, tz=BERLIN), 2, BERLIN) == [
        datetime(2026, 3, 29, 3, 0), datetime(2026, 3, 30, 2, 30)]


def test_a_fixed_time_in_the_repeated_hour_runs_once():
    cron = parse("30 2 * * *")
    first = cron.next_after(ts(2026, 10, 24, 12, tz=BERLIN), BERLIN)
    second = cron.next_after(first, BERLIN)
    assert at(first, BERLIN) == datetime(2026, 10, 25, 2, 30)
    assert at(second, BERLIN) == datetime(2026, 10, 26, 2, 30)


def test_a_wildcard_minute_follows_the_wall_clock_through_both_passes():
    cron, t, seen = parse("*/30 2 * * *"), ts(2026, 10, 25, 1, tz=BERLIN), []
    for _ in range(5):
        t = cron.next_after(t, BERLIN)
        seen.append(datetime.fromtimestamp(t, UTC).strftime("%H:%M"))
    assert seen == ["00:00", "00:30", "01:00", "01:30", "01:00"]  # UTC; the last is Oct 26


CHATHAM = ZoneInfo("Pacific/Chatham")  # on 2027-04-04 the clocks go back from 03:45 to 02:45


@pytest.mark.parametrize(("expr", "second_pass"), [
    ("* 2 * * *", ["02:45", "02:46", "02:47"]),
    ("*/7 2 * * *", ["02:49", "02:56", "02:00"]),  # the last on the next day
])
def test_a_wildcard_job_runs_in_a_repeated_stretch_that_starts_off_the_hour(expr, second_pass):
    # From late in the first pass of 02:xx, next_after jumped to the next day's 02:00 and
    # stepped over 02:45-02:59 the second time round, which is_due calls due.
    cron, t, seen = parse(expr), ts(2027, 4, 4, 2, 59, tz=CHATHAM), []
    for _ in range(3):
        t = cron.next_after(t, CHATHAM)
        assert cron.is_due(t, CHATHAM)
        seen.append(datetime.fromtimestamp(t, CHATHAM).strftime("%H:%M"))
    assert seen == second_pass


@pytest.mark.parametrize("expr", ["* 2 * * *", "*/7 2 * * *", "30 2 * * *", "* * * * *",
                                  "15,45 1-3 * * *"])
def test_next_after_agrees_with_is_due_across_chathams_setback(expr):
    cron, start = parse(expr), ts(2027, 4, 4, 0, tz=CHATHAM)
    for t in range(int(start), int(start) + 6 * 3600, 600):
        found, minute = cron.next_after(t, CHATHAM), (t // 60 + 1) * 60
        while minute < found:
            assert not cron.is_due(minute, CHATHAM), (t, minute)
            minute += 60
        assert cron.is_due(found, CHATHAM)


def test_hourly_jobs_lose_the_skipped_hour_and_keep_real_time():
    got = runs("0 * * * *", ts(2026, 3, 29, 0, 30, tz=BERLIN), 3, BERLIN)
    assert got == [datetime(2026, 3, 29, 1), datetime(2026, 3, 29, 3), datetime(2026, 3, 29, 4)]


# -- property: next_after agrees with is_due checked minute by minute ---------------------------

_FIELD = st.sampled_from(["*", "*/5", "*/17", "0", "1-10", "3,7,30", "20-40/7", "59"])
_HOUR = st.sampled_from(["*", "2", "0-3", "*/6", "1,2,3", "22-23"])
_DOM = st.sampled_from(["*", "1", "13", "*/2", "28-31", "15"])
_MONTH = st.sampled_from(["*", "3", "10", "mar,oct", "*/4"])
_DOW = st.sampled_from(["*", "0", "sun", "1-5", "fri", "6,7"])
_START = st.integers(ts(2026, 3, 25), ts(2026, 11, 1))


@settings(max_examples=60, deadline=None)
@given(_FIELD, _HOUR, _DOM, _MONTH, _DOW, _START, st.sampled_from([UTC, BERLIN]))
def test_next_after_is_the_first_due_minute(minute, hour, dom, month, dow, start, tz):
    cron = parse(f"{minute} {hour} {dom} {month} {dow}")
    found = cron.next_after(start, tz)
    t = (start // 60 + 1) * 60
    window_end = t + 2 * 86400
    while t < window_end and not cron.is_due(t, tz):
        t += 60
    if t < window_end:
        assert found == t
    else:
        assert found >= window_end
    if tz is UTC:  # with no DST, due means the wall minute matches
        assert cron.matches_wall(at(found))


class CountingZone(tzinfo):
    """Europe/Berlin, counting the wall-clock conversions asked of it: the work next_after does
    is one or two conversions per candidate minute it looks at."""

    def __init__(self) -> None:
        self.conversions = 0

    def utcoffset(self, dt):
        return BERLIN.utcoffset(dt)

    def dst(self, dt):
        return BERLIN.dst(dt)

    def tzname(self, dt):
        return BERLIN.tzname(dt)

    def fromutc(self, dt):
        self.conversions += 1
        return BERLIN.fromutc(dt.replace(tzinfo=BERLIN)).replace(tzinfo=self)


@pytest.mark.parametrize(("expr", "start", "expected"), [
    ("0 0 29 2 */7", ts(2026, 11, 27), ts(2032, 2, 29, tz=BERLIN)),      # 29 Feb on a Sunday
    ("0 0 */31 11 */7", ts(2028, 11, 27), ts(2037, 11, 1, tz=BERLIN)),  # 1 Nov on a Sunday
    ("59 23 31 12 */7", ts(2026, 11, 27), ts(2028, 12, 31, 23, 59, tz=BERLIN)),
    ("0 0 */30 * */7", ts(2026, 11, 27), ts(2027, 1, 31, tz=BERLIN)),
    ("* * 29 2 */7", ts(2026, 11, 27), ts(2032, 2, 29, tz=BERLIN)),     # wildcard: DST probes
])
def test_a_rare_date_costs_a_few_conversions_not_one_per_day(expr, start, expected):
    # The tick and the listings ask next_after of every schedule: a date years away must not
    # be found by walking each of its months' days through the time zone (the old walk made
    # several hundred conversions for '0 0 29 2 */7', 1-4 ms a schedule).
    zone = CountingZone()
    assert parse(expr).next_after(start, zone) == expected
    assert zone.conversions <= 20


def test_past_the_horizon_is_refused_after_a_few_conversions():
    zone = CountingZone()
    with pytest.raises(CronError, match="no due minute in the next nine years"):
        parse("0 0 */31 11 */7").next_after(ts(2026, 11, 27), zone)
    assert zone.conversions <= 20
