"""Budget periods: calendar-aligned in a time zone (COVEY_BUDGET_TIME_ZONE). No Django.

A daily period starts at midnight, a weekly one on Monday at midnight, a monthly one on the
first at midnight, all in local time (so a day across a daylight-saving change is 23 or 25
hours long); ``none`` is one period from the beginning that never ends.
"""

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

NONE, DAILY, WEEKLY, MONTHLY = "none", "daily", "weekly", "monthly"
PERIODS = (NONE, DAILY, WEEKLY, MONTHLY)
BEGINNING = datetime(2000, 1, 1, tzinfo=UTC)  # where a period of "none" starts


def bounds(period: str, at: datetime, zone: ZoneInfo) -> tuple[datetime, datetime | None]:
    """The period of kind ``period`` that holds ``at``: its start, and its end (None: never)."""
    if period == NONE:
        return BEGINNING, None
    day = at.astimezone(zone).date()
    if period == DAILY:
        first, after = day, day + timedelta(days=1)
    elif period == WEEKLY:
        first = day - timedelta(days=day.weekday())
        after = first + timedelta(days=7)
    elif period == MONTHLY:
        first = day.replace(day=1)
        after = (first + timedelta(days=32)).replace(day=1)
    else:
        raise ValueError(f"{period!r} is not a budget period (one of {', '.join(PERIODS)})")
    return _midnight(first, zone), _midnight(after, zone)


def _midnight(day: date, zone: ZoneInfo) -> datetime:
    return datetime.combine(day, time.min, tzinfo=zone).astimezone(UTC)
