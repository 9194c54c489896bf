"""System checks for the runners' settings: targets the egress probe could not try (the ids
are egress's, where the settings are documented), a home quota below zero, and a staleness
that healthy runners would flap across, each stopping start-up with a clear id."""

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from allowlists.entries import EntryError, parse_entry
from runners.auth import SEEN_EVERY_SECONDS
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


@register("covey")
def check_runner_staleness(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A runner is marked seen at most every SEEN_EVERY_SECONDS, by a call that comes every
    heartbeat, so a healthy runner's mark can be that much plus a heartbeat old: a runner not
    heard from for less than that must not be taken for offline."""
    stale = settings.COVEY_RUNNER_STALE_SECONDS
    heartbeat = settings.COVEY_RUNNER_HEARTBEAT_SECONDS
    least = SEEN_EVERY_SECONDS + heartbeat
    if stale > least:
        return []
    return [
        Error(
            f"COVEY_RUNNER_STALE_SECONDS is {stale:g}: a runner is marked seen at most every"
            f" {SEEN_EVERY_SECONDS} s, and calls every COVEY_RUNNER_HEARTBEAT_SECONDS"
            f" ({heartbeat:g} s), so a healthy runner can go {least:g} s unmarked and would flap"
            " offline (its homes answering 503, no work placed on it)",
            hint=f"Give more than {least:g} seconds (30 unless said), or a shorter heartbeat.",
            id="runners.E002",
        )
    ]
