"""What a runner host is told at start: :meth:`HostSettings.from_environment` reads it from the
process's environment (the same ``COVEY_*`` variables the control plane documents), with no
Django, for ``python -m runners.host`` and ``manage.py runner`` alike."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import environ

from egress.environment import SETTING_VALUES, Isolation
from egress.proxy.config import ProxyConfig
from runners.probe.checks import Targets

# The checkout's var/, where the control plane keeps its files unless COVEY_VAR_DIR says
# otherwise (covey/var.py takes it from here: one reading of the variable).
CHECKOUT_VAR_DIR = Path(__file__).resolve().parents[2] / "var"


def var_dir(environment: Mapping[str, str] | None = None) -> Path:
    """``COVEY_VAR_DIR``, else ``var/`` in the checkout."""
    return Path(_env(environment).str("COVEY_VAR_DIR", default="") or CHECKOUT_VAR_DIR)


def builtin_dir(var_dir: Path) -> Path:
    """Where the control plane leaves the built-in runners' identities for the runner host."""
    return var_dir / "runners" / "builtin"


@dataclass
class HostSettings:
    homes: Path  # <homes>/<runner id>/<agent id> is an agent's home
    proxy: str = ""  # host:port of the egress proxy as sandboxes reach it
    network: str | None = None
    poll: float = 0.5
    # Hard isolation: the proxy container's image (pinned to its ID at the first build), the
    # control plane's URL as that container reaches it ("": the runner's own), and more
    # variables for it (its resolvers, the private ranges it may reach).
    isolation: Isolation = Isolation.COOPERATIVE
    isolation_level: str = "none"  # COVEY_EGRESS_ISOLATION as given (checked at start)
    proxy_image: str = "covey-egress:latest"
    proxy_control_plane_url: str = ""
    proxy_environment: Mapping[str, str] = field(default_factory=dict, repr=False)  # a token
    # The egress probe: what stands for the outside world, and how long a runner whose probe
    # failed waits before it probes again on its own.
    probe_targets: Targets = field(default_factory=Targets)
    probe_retry: float = 300.0
    # The image the proxy check runs in (it needs python3): the probe's.
    check_image: str = "covey-base:trixie"
    # How long a launch waits for a proxy that does not answer before it is refused.
    proxy_wait: float = 20.0
    # Workplace images (containers/builds.py): apt's sources for the build ("": the base
    # image's), the build's network ("": Docker's default bridge), and the package index and
    # registry pip and npm fetch from on this host ("": their own configuration's).
    apt_sources: Path | None = None
    build_network: str | None = None
    pip_index_url: str = ""
    npm_registry: str = ""
    # The process around the host (runners/host/__main__.py): its directory (the built-in
    # runners' identities, a remote runner's file, the file-system broker), the control plane
    # built-in runners call, the broker its orders come through, how often it sends heartbeats,
    # where it answers /healthz, /readyz and /metrics ("": nowhere) and the token /metrics
    # answers, the image of agents without a workplace (checked at start), and its log lines.
    var_dir: Path = CHECKOUT_VAR_DIR
    control_plane_url: str = "http://127.0.0.1:8000"
    broker_url: str = field(default="filesystem://", repr=False)  # it may carry a password
    heartbeat: float = 5.0
    status_listen: str = ""
    metrics_token: str = field(default="", repr=False)
    default_image: str = "covey-workplace:latest"
    log_format: str = "text"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        # A str subclass is truthy whatever its value: ``if settings.isolation`` would be a bug.
        self.isolation = Isolation(self.isolation)

    @property
    def hard(self) -> bool:
        """Hard isolation: the proxy container is the sandboxes' only exit."""
        return self.isolation is Isolation.NETWORK

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> "HostSettings":
        """The settings in ``environment`` (the process's by default); ValueError for a value
        that is not of its kind. What the values mean together is checked at start."""
        env = _env(environment)
        var = var_dir(environment)
        proxy = ProxyConfig.from_environment(environment)  # the variables it shares with the proxy
        apt_sources = env.str("COVEY_WORKPLACE_APT_SOURCES", default="")
        level = env.str("COVEY_EGRESS_ISOLATION", default=cls.isolation_level)
        return cls(
            homes=Path(env.str("COVEY_RUNNER_HOMES", default="") or var / "homes"),
            proxy=env.str("COVEY_RUNNER_PROXY", default=""),
            network=env.str("COVEY_RUNNER_NETWORK", default="") or None,
            # An unknown level is refused at start (process.check) and by the control plane's
            # system check; meanwhile it is not taken for hard isolation.
            isolation=SETTING_VALUES.get(level, Isolation.COOPERATIVE),
            isolation_level=level,
            proxy_image=env.str("COVEY_RUNNER_PROXY_IMAGE", default=cls.proxy_image),
            proxy_control_plane_url=env.str("COVEY_RUNNER_PROXY_CONTROL_PLANE_URL", default=""),
            proxy_environment=proxy_environment(proxy),
            probe_targets=Targets.from_environment(environment),
            probe_retry=env.float("COVEY_RUNNER_PROBE_RETRY_SECONDS", default=cls.probe_retry),
            check_image=env.str("COVEY_PROBE_IMAGE", default=cls.check_image),
            proxy_wait=env.float("COVEY_RUNNER_PROXY_WAIT_SECONDS", default=cls.proxy_wait),
            apt_sources=Path(apt_sources) if apt_sources else None,
            build_network=env.str("COVEY_WORKPLACE_BUILD_NETWORK", default="") or None,
            pip_index_url=env.str("COVEY_WORKPLACE_PIP_INDEX_URL", default=""),
            npm_registry=env.str("COVEY_WORKPLACE_NPM_REGISTRY", default=""),
            var_dir=var,
            control_plane_url=proxy.control_plane_url or cls.control_plane_url,
            broker_url=env.str("CELERY_BROKER_URL", default=cls.broker_url),
            heartbeat=env.float("COVEY_RUNNER_HEARTBEAT_SECONDS", default=cls.heartbeat),
            status_listen=env.str("COVEY_RUNNER_STATUS_LISTEN", default=""),
            metrics_token=proxy.metrics_token,
            default_image=env.str("COVEY_DEFAULT_IMAGE", default=cls.default_image),
            log_format=env.str("COVEY_LOG_FORMAT", default=cls.log_format),
            log_level=env.str("COVEY_LOG_LEVEL", default=cls.log_level),
        )


def proxy_environment(proxy: ProxyConfig) -> dict[str, str]:
    """What the proxy container takes from this host's settings: it resolves and connects
    from here, so where it asks for names and which private ranges it may reach are the
    runner host's to say, as are how often it polls, how long it trusts a policy whose source
    went silent and how long a client has to send a request head; and the token its /metrics
    answers (on its status port, which sandboxes cannot reach)."""
    environment = {
        "COVEY_EGRESS_POLICY_POLL": f"{proxy.poll:g}",
        "COVEY_EGRESS_POLICY_GRACE": f"{proxy.grace:g}",
        "COVEY_EGRESS_HEAD_TIMEOUT": f"{proxy.head_timeout:g}",
    }
    if proxy.nameservers:
        environment["COVEY_EGRESS_NAMESERVERS"] = ",".join(proxy.nameservers)
    if proxy.allowed_private_cidrs:
        environment["COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS"] = ",".join(proxy.allowed_private_cidrs)
    if proxy.metrics_token:
        environment["COVEY_METRICS_TOKEN"] = proxy.metrics_token
    return environment


def _env(environment: Mapping[str, str] | None) -> environ.Env:
    env = environ.Env()
    if environment is not None:
        env.ENVIRON = dict(environment)
    return env
