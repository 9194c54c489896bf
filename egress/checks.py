"""System checks for egress settings, so a bad configuration stops start-up with a clear id."""

import ipaddress
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from allowlists.entries import EntryError, parse_entries

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
