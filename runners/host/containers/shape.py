"""What one runner's hard isolation is made of (docs/isolation.md): the :class:`Shape` as
built, the names of its networks, bridge and proxy container, the labels covey puts on them,
and the error every part raises. runners/host/containers/isolation.py builds and checks it,
with networks.py and proxy.py."""

import hashlib
import re
from dataclasses import dataclass

from docker.errors import APIError

PROXY_PORT = 3128
# The proxy's /healthz, /readyz and /metrics, on its networks (a sandbox reaches PROXY_PORT
# only: the firewall drops the rest); the runner asks /readyz on the outward side.
PROXY_STATUS_PORT = 9090
# Labels. The proxy does not carry covey.runner: the engine treats every container with that
# label as a sandbox (Engine.sandboxes), and the runner's reconcile would remove it.
LABEL_ISOLATION = "covey.isolation"  # runner name, on the networks and the proxy
LABEL_ROLE = "covey.role"  # internal, outward, egress-proxy

_RUNNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class IsolationError(Exception):
    """The isolation shape could not be built or repaired; the message says what and why."""


@dataclass(frozen=True)
class Shape:
    """One runner's isolation, as built: what the runner needs to place sandboxes in it."""

    runner: str
    image_id: str  # the pin: the proxy runs this image ID, whatever its tag says later
    internal_network: str
    internal_network_id: str
    outward_network: str
    outward_network_id: str
    bridge: str  # the internal network's interface on the host
    subnet: str
    gateway: str  # the host's address on the internal network
    proxy_ip: str  # the proxy's address on the internal network
    proxy_container: str
    proxy_container_id: str = ""


def internal_network_name(runner: str) -> str:
    """The name of the runner's internal network."""
    return f"covey-internal-{runner}"


def outward_network_name(runner: str) -> str:
    """The name of the network the runner's proxy goes out through."""
    return f"covey-outward-{runner}"


def proxy_container_name(runner: str) -> str:
    """The name of the runner's proxy container."""
    return f"covey-egress-{runner}"


def bridge_name(runner: str) -> str:
    """The host interface of the runner's internal network (at most 15 characters)."""
    return "covey" + hashlib.sha256(runner.encode()).hexdigest()[:10]


def check_runner(runner: str) -> str:
    """Refuse a runner name that cannot name networks, containers and rule comments."""
    if not _RUNNER.match(runner):
        raise ValueError(
            f"runner name {runner!r} must be 1 to 63 letters, digits, '_', '.' or '-',"
            " starting with a letter or digit"
        )
    return runner


def explain(exc: APIError) -> str:
    """What the Docker engine said when it refused."""
    return str(exc.explanation or exc)
