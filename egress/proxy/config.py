"""The proxy's settings: the same ``COVEY_EGRESS_*`` variables the control plane reads."""

from collections.abc import Mapping
from dataclasses import dataclass, field

import environ


@dataclass(frozen=True)
class ProxyConfig:
    """How a proxy runs; the defaults are covey's (covey/settings.py takes them from here)."""

    poll: float = 0.25  # COVEY_EGRESS_POLICY_POLL: seconds between checks for policy changes
    grace: float = 15.0  # COVEY_EGRESS_POLICY_GRACE: trust in the last policy once it is gone
    max_tunnels: int = 4000  # COVEY_EGRESS_MAX_TUNNELS
    max_tunnels_per_agent: int = 500  # COVEY_EGRESS_MAX_TUNNELS_PER_AGENT
    head_timeout: float = 60.0  # COVEY_EGRESS_HEAD_TIMEOUT: seconds a client has to send a head
    nameservers: tuple[str, ...] = ()  # COVEY_EGRESS_NAMESERVERS: addr or addr@port
    allowed_private_cidrs: tuple[str, ...] = ()  # COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS
    control_plane_url: str = ""  # COVEY_CONTROL_PLANE_URL (a proxy on a runner host)
    runner_token: str = field(default="", repr=False)  # COVEY_RUNNER_TOKEN
    status_listen: str = ""  # COVEY_EGRESS_STATUS_LISTEN: HOST:PORT of /readyz, /metrics ("": none)
    metrics_token: str = field(default="", repr=False)  # COVEY_METRICS_TOKEN

    def timing_problem(self) -> str:
        """What is wrong with the policy's timing (poll and grace), or "": a proxy that asks its
        source less often than it trusts what it holds refuses everything between two asks, and
        so does one whose grace a late answer outlasts (a grace of two polls at least)."""
        if not self.poll > 0:  # NaN too
            return f"COVEY_EGRESS_POLICY_POLL is {self.poll:g}: give the seconds between polls"
        if not self.grace >= 2 * self.poll:
            return (
                f"COVEY_EGRESS_POLICY_GRACE ({self.grace:g} s) is shorter than twice"
                f" COVEY_EGRESS_POLICY_POLL ({self.poll:g} s): the proxy would refuse every"
                " connection whenever a poll's answer came late"
            )
        return ""

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> "ProxyConfig":
        """The settings in ``environment`` (the process's by default)."""
        env = environ.Env()
        if environment is not None:
            env.ENVIRON = dict(environment)
        default = cls()
        return cls(
            poll=env.float("COVEY_EGRESS_POLICY_POLL", default=default.poll),
            grace=env.float("COVEY_EGRESS_POLICY_GRACE", default=default.grace),
            max_tunnels=env.int("COVEY_EGRESS_MAX_TUNNELS", default=default.max_tunnels),
            max_tunnels_per_agent=env.int(
                "COVEY_EGRESS_MAX_TUNNELS_PER_AGENT", default=default.max_tunnels_per_agent
            ),
            head_timeout=env.float("COVEY_EGRESS_HEAD_TIMEOUT", default=default.head_timeout),
            nameservers=tuple(env.list("COVEY_EGRESS_NAMESERVERS", default=[])),
            allowed_private_cidrs=tuple(env.list("COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS", default=[])),
            control_plane_url=env.str("COVEY_CONTROL_PLANE_URL", default=""),
            runner_token=env.str("COVEY_RUNNER_TOKEN", default=""),
            status_listen=env.str("COVEY_EGRESS_STATUS_LISTEN", default=""),
            metrics_token=env.str("COVEY_METRICS_TOKEN", default=""),
        )
