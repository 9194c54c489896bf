"""The two levels of egress (:class:`Isolation`), and what a sandbox is told about the proxy at
the cooperative level (COVEY_EGRESS_ENFORCE).

Cooperative means exactly that: well-behaved tools (curl, pip, npm, git, apt with its proxy
setting) honour these variables, and a process that ignores them can go around the proxy.
Only COVEY_EGRESS_ISOLATION=network makes the proxy the sandbox's only way out.
"""

from collections.abc import Sequence
from enum import StrEnum
from typing import Self
from urllib.parse import quote


class Isolation(StrEnum):
    """What a runner host enforces: the one spelling of the level everywhere (the runner's
    settings, its heartbeat and probes, the control plane's records and API)."""

    NETWORK = "network"  # hard: an internal network whose only exit is the proxy container
    COOPERATIVE = "cooperative"  # sandboxes are told of the proxy, and may go around it

    @classmethod
    def from_setting(cls, value: str) -> Self:
        """The level COVEY_EGRESS_ISOLATION names (``none`` or ``network``); ValueError
        saying what it may be otherwise."""
        try:
            return cls(SETTING_VALUES[value])
        except KeyError:
            raise ValueError(
                f"COVEY_EGRESS_ISOLATION is {value!r}: use one of {', '.join(SETTING_VALUES)}"
            ) from None


# COVEY_EGRESS_ISOLATION's values: "none" (the cooperative level) predates the enum's names.
SETTING_VALUES = {"none": Isolation.COOPERATIVE, "network": Isolation.NETWORK}

# The sandbox's own loopback is the sandbox itself; everything else goes through the proxy.
NO_PROXY = "localhost,127.0.0.1,::1"
# The proxy's request desk (egress/proxy/desk.py), which sandboxes reach through it (.invalid
# is reserved: no real host has the name), and the header that carries the SHA-256 of the
# agent's credential from the proxy to the control plane.
DESK_HOST = "requests.covey.invalid"
DESK_TOKEN_HEADER = "X-Covey-Token-SHA256"  # noqa: S105 - a header's name


def proxy_environment(
    proxy_host: str, proxy_port: int, credentials: str, direct: Sequence[str] = ()
) -> dict[str, str]:
    """HTTP(S)_PROXY in both spellings, carrying the agent's ``username:token``; ``direct``:
    more names the sandbox reaches without the proxy (its workplace's services, which are its
    own loopback)."""
    username, _, token = credentials.partition(":")
    url = f"http://{quote(username, safe='')}:{quote(token, safe='')}@{proxy_host}:{proxy_port}"
    env = {}
    for name in ("http_proxy", "https_proxy"):
        env[name] = env[name.upper()] = url
    env["no_proxy"] = env["NO_PROXY"] = ",".join([NO_PROXY, *direct])
    return env
