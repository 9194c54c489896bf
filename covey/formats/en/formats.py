"""Dates and times in the admin as covey writes them everywhere: 2026-12-06 14:03:07, not
"Dec. 6, 2026, 2:03 p.m." beside it (covey/display.py writes the same)."""

DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATE_FORMAT = "Y-m-d"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s"
