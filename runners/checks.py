"""System checks for the egress probe's settings: targets the probe could not try stop
start-up with a clear id (the ids are egress's, where the settings are documented)."""

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from allowlists.entries import EntryError, parse_entry
from runners.probe.checks import parse_address

PROBE_ADDRESS_LISTS = (
    "COVEY_EGRESS_PROBE_INTERNET",
    "COVEY_EGRESS_PROBE_PRIVATE",
    "COVEY_EGRESS_PROBE_METADATA",
    "COVEY_EGRESS_PROBE_RESOLVERS",
    "COVEY_EGRESS_PROBE_IPV6",
)


@register("covey")
def check_probe_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Reject probe targets the probe could not try."""
    errors: list[CheckMessage] = []
    for name in ("COVEY_EGRESS_PROBE_ALLOWED", "COVEY_EGRESS_PROBE_OFF_LIST"):
        value = getattr(settings, name)
        if not value and name.endswith("ALLOWED"):
            continue  # the organisation's base list decides
        try:
            parse_entry(value)
        except EntryError as exc:
            errors.append(
                Error(
                    f"{name} is not host[:port]: {exc}",
                    hint="e.g. example.com:443",
                    id="egress.E005",
                )
            )
    for name in PROBE_ADDRESS_LISTS:
        for text in getattr(settings, name):
            try:
                parse_address(text, 53 if name.endswith("RESOLVERS") else None)
            except ValueError as exc:
                errors.append(
                    Error(
                        f"{name}: {exc}",
                        hint="Give ip:port entries ([v6]:port for IPv6).",
                        id="egress.E006",
                    )
                )
    return errors


@register("covey")
def check_home_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A home quota is a number of MiB, 0 for none."""
    if settings.COVEY_HOME_QUOTA_MB < 0:
        return [
            Error(
                f"COVEY_HOME_QUOTA_MB is {settings.COVEY_HOME_QUOTA_MB}: it would refuse every run",
                hint="Give the MiB an agent's home may hold, or 0 for no quota.",
                id="runners.E001",
            )
        ]
    return []
