"""System checks for egress settings, so a bad configuration stops start-up with a clear id."""

import ipaddress
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from allowlists.entries import EntryError, parse_entries, parse_entry
from egress.probe import parse_address

ISOLATION_LEVELS = ("none", "network")


@register("covey")
def check_egress_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Reject egress settings that would make the proxy's decisions wrong or ambiguous."""
    errors: list[CheckMessage] = []
    try:
        parse_entries(settings.COVEY_EGRESS_BASE_ALLOWLIST)
    except EntryError as exc:
        errors.append(
            Error(
                f"COVEY_EGRESS_BASE_ALLOWLIST has bad entries: {exc}",
                hint="Use comma-separated host or host:port entries.",
                id="egress.E001",
            )
        )
    if settings.COVEY_EGRESS_ISOLATION not in ISOLATION_LEVELS:
        errors.append(
            Error(
                f"COVEY_EGRESS_ISOLATION is {settings.COVEY_EGRESS_ISOLATION!r}.",
                hint=f"Use one of: {', '.join(ISOLATION_LEVELS)}.",
                id="egress.E002",
            )
        )
    for cidr in settings.COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS:
        try:
            ipaddress.ip_network(cidr)
        except ValueError as exc:
            errors.append(
                Error(
                    f"COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS has a bad network: {exc}",
                    hint="Use networks such as 10.20.0.0/16 with host bits clear.",
                    id="egress.E003",
                )
            )
    for server in settings.COVEY_EGRESS_NAMESERVERS:
        try:
            ipaddress.ip_address(server.rsplit("@", 1)[0])
        except ValueError:
            errors.append(
                Error(
                    f"COVEY_EGRESS_NAMESERVERS has {server!r}, which is not an IP address.",
                    hint="Give name servers as addresses, optionally address@port.",
                    id="egress.E004",
                )
            )
    return errors


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
