"""System checks for egress settings, so a bad configuration stops start-up with a clear id."""

import ipaddress
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from allowlists.entries import EntryError, parse_entries
from egress.environment import SETTING_VALUES, Isolation
from egress.proxy.config import ProxyConfig


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
    try:
        Isolation.from_setting(settings.COVEY_EGRESS_ISOLATION)
    except ValueError:
        errors.append(
            Error(
                f"COVEY_EGRESS_ISOLATION is {settings.COVEY_EGRESS_ISOLATION!r}.",
                hint=f"Use one of: {', '.join(SETTING_VALUES)}.",
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
    timing = ProxyConfig(
        poll=settings.COVEY_EGRESS_POLICY_POLL, grace=settings.COVEY_EGRESS_POLICY_GRACE
    ).timing_problem()
    if timing:
        errors.append(
            Error(
                timing,
                hint="Give a grace of two polls or more (15 s and 0.25 s unless said).",
                id="egress.E005",
            )
        )
    return errors
