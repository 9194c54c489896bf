"""What a runner host is told at start (``manage.py runner`` reads it from the environment)."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from egress.environment import Isolation
from runners.probe import host as probing


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
    proxy_image: str = "covey-egress:latest"
    proxy_control_plane_url: str = ""
    proxy_environment: Mapping[str, str] = field(default_factory=dict)
    # The egress probe: what stands for the outside world, and how long a runner whose probe
    # failed waits before it probes again on its own.
    probe_targets: probing.Targets = field(default_factory=probing.Targets)
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

    def __post_init__(self) -> None:
        # A str subclass is truthy whatever its value: ``if settings.isolation`` would be a bug.
        self.isolation = Isolation(self.isolation)

    @property
    def hard(self) -> bool:
        """Hard isolation: the proxy container is the sandboxes' only exit."""
        return self.isolation is Isolation.NETWORK
