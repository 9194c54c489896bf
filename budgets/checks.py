"""Budget settings, checked when covey starts (``manage.py check`` and every command)."""

from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core.checks import Error, register

from budgets import keys


@register()
def budget_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    try:
        ZoneInfo(settings.COVEY_BUDGET_TIME_ZONE)
    except (ZoneInfoNotFoundError, ValueError):
        return [
            Error(
                f"COVEY_BUDGET_TIME_ZONE is {settings.COVEY_BUDGET_TIME_ZONE!r}, which is not a"
                " time zone.",
                hint="Use an IANA name such as UTC or Europe/Berlin.",
                id="budgets.E001",
            )
        ]
    try:
        keys.gateway_destination(settings.COVEY_MODEL_GATEWAY_URL)
    except ValueError as exc:
        return [
            Error(
                f"COVEY_MODEL_GATEWAY_URL is {settings.COVEY_MODEL_GATEWAY_URL!r}: {exc}.",
                hint="It is the address sandboxes reach the model gateway at.",
                id="budgets.E002",
            )
        ]
    return []
