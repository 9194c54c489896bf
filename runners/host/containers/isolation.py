"""Hard isolation (``COVEY_EGRESS_ISOLATION=network``): the egress proxy is a sandbox's only exit.

Per runner: an internal network sandboxes join (no route out), an outward network, the proxy
container on both at a fixed address, and host firewall rules (runners/host/firewall.py) for
what ``--internal`` leaves open. docs/isolation.md has the threat model and what Docker leaves
open, found on a real runner, which these rules close.

The docker SDK and the ``iptables``/``ip6tables`` commands; no Django (runner hosts have no
database). Needs root (the firewall).
"""

import ipaddress
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound

from runners.host import firewall
from runners.host.containers import networks, proxy
from runners.host.containers.networks import DEFAULT_POOL
from runners.host.containers.shape import (
    PROXY_PORT,
    PROXY_STATUS_PORT,
    IsolationError,
    Shape,
    bridge_name,
    check_runner,
    explain,
    internal_network_name,
    outward_network_name,
    proxy_container_name,
)

NO_RESOLVER = "0.0.0.0"  # noqa: S104 - an address to send to, not to bind
SANDBOX_DNS_OPT = ("timeout:1", "attempts:1")
SANDBOX_SYSCTLS = {
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
_DANGEROUS_CAPS = frozenset({"ALL", "NET_ADMIN", "NET_RAW", "SYS_ADMIN", "CAP_NET_ADMIN"})


# --- what sandboxes get ---------------------------------------------------------------------


def proxy_address(shape: Shape) -> str:
    """The proxy as sandboxes reach it, ``ip:port``."""
    return f"{shape.proxy_ip}:{PROXY_PORT}"


def sandbox_network_options(shape: Shape) -> dict[str, Any]:
    """Create options (docker SDK names, also SandboxSpec fields) that put a sandbox on the
    internal network alone, with no resolver of the host and no IPv6."""
    return {
        "network": shape.internal_network,
        "dns": [NO_RESOLVER],
        "dns_opt": list(SANDBOX_DNS_OPT),
        "sysctls": dict(SANDBOX_SYSCTLS),
    }


def check_sandbox_networks(container_attrs: Mapping[str, Any], shape: Shape) -> list[str]:
    """What would give a sandbox (``docker inspect`` of it, created or running) a way around
    the proxy; empty when nothing does."""
    problems = []
    host = container_attrs.get("HostConfig") or {}
    mode = host.get("NetworkMode") or "default"
    if mode not in (shape.internal_network, shape.internal_network_id):
        problems.append(f"its network mode is {mode}, not {shape.internal_network}")
    networks = (container_attrs.get("NetworkSettings") or {}).get("Networks") or {}
    others = sorted(set(networks) - {shape.internal_network})
    if others:
        problems.append(f"it is also on {', '.join(others)}")
    if shape.internal_network not in networks:
        problems.append(f"it is not on {shape.internal_network}")
    else:
        network_id = networks[shape.internal_network].get("NetworkID")
        if network_id and network_id != shape.internal_network_id:
            problems.append(f"it is on an older {shape.internal_network} ({network_id[:12]})")
    if list(host.get("Dns") or []) != [NO_RESOLVER]:
        problems.append(
            f"its DNS upstream is {host.get('Dns') or 'the host resolvers'}, not {NO_RESOLVER}"
        )
    sysctls = host.get("Sysctls") or {}
    for key, value in SANDBOX_SYSCTLS.items():
        if sysctls.get(key) != value:
            problems.append(f"it does not set {key}={value}")
    if host.get("Privileged"):
        problems.append("it is privileged")
    caps = {str(cap).upper() for cap in host.get("CapAdd") or []}
    if caps & _DANGEROUS_CAPS:
        problems.append(f"it adds {', '.join(sorted(caps & _DANGEROUS_CAPS))}")
    if host.get("PortBindings"):
        problems.append("it publishes ports")
    return problems


# --- shape ----------------------------------------------------------------------------------


def ensure_shape(
    runner: str,
    image: str,
    control_plane_url: str,
    runner_token: str,
    *,
    environment: Mapping[str, str] | None = None,
    pool: str = DEFAULT_POOL,
    client: docker.DockerClient | None = None,
    ready_timeout: float = 60.0,
) -> Shape:
    """Build or repair the runner's networks, firewall rules and proxy; return the shape.

    ``image`` is resolved to its ID once (the pin, in ``Shape.image_id``: the caller records
    it). Everything is checked at every call: a wrong network is recreated when no sandbox is
    on it (otherwise IsolationError says which are); a proxy that is missing, stopped, on
    another image ID, on other networks or with another environment (a renewed token) is
    recreated. Waits until the proxy accepts connections (``ready_timeout`` seconds; it listens
    once it has policy, or after COVEY_EGRESS_POLICY_GRACE).
    """
    check_runner(runner)
    if not control_plane_url or not runner_token:
        raise ValueError("the proxy needs the control plane's URL and the runner token")
    network_pool = networks.parse_pool(pool)
    client = _client(client)
    image_id = resolve_image(client, image)
    internal = networks.ensure(
        client,
        runner,
        internal_network_name(runner),
        lambda attrs: networks.internal_problems(attrs, runner, network_pool),
        lambda: networks.create_internal(client, runner, network_pool),
    )
    outward = networks.ensure(
        client,
        runner,
        outward_network_name(runner),
        lambda attrs: networks.outward_problems(attrs, runner),
        lambda: networks.create_outward(client, runner),
    )
    shape = _shape(runner, image_id, internal, outward)
    ensure_rules(shape)  # before the proxy, and so before any sandbox can be attached
    env = {
        **(environment or {}),
        "COVEY_CONTROL_PLANE_URL": control_plane_url,
        "COVEY_RUNNER_TOKEN": runner_token,
        "COVEY_EGRESS_STATUS_LISTEN": f"0.0.0.0:{PROXY_STATUS_PORT}",
    }
    container = proxy.ensure(client, shape, env)
    shape = replace(shape, proxy_container_id=container["Id"])
    proxy.wait_ready(client, shape, ready_timeout)
    return shape


def check_shape(
    runner: str,
    image_id: str,
    *,
    pool: str = DEFAULT_POOL,
    client: docker.DockerClient | None = None,
) -> list[str]:
    """What is wrong with the runner's networks and proxy (nothing is changed); empty when
    they are as :func:`ensure_shape` builds them, the proxy on ``image_id``."""
    check_runner(runner)
    network_pool = networks.parse_pool(pool)
    client = _client(client)
    problems: list[str] = []
    internal = networks.one(
        client,
        internal_network_name(runner),
        lambda attrs: networks.internal_problems(attrs, runner, network_pool),
        problems,
    )
    outward = networks.one(
        client,
        outward_network_name(runner),
        lambda a: networks.outward_problems(a, runner),
        problems,
    )
    if internal is None or outward is None:
        return problems
    shape = _shape(runner, image_id, internal, outward)
    return problems + proxy.state_problems(client, shape, image_id)


def preflight(
    shape: Shape,
    expected_image_id: str,
    runner: str,
    *,
    client: docker.DockerClient | None = None,
) -> list[str]:
    """Everything that must hold before a sandbox is placed in the shape; empty = ok.

    The proxy runs ``expected_image_id`` (the recorded pin) and accepts connections; the
    internal network exists, is internal and is the one in ``shape``; the outward network is
    the one in ``shape``; the firewall rules are in place; the kernel filters bridged traffic.
    """
    if runner != shape.runner:
        return [f"the shape is runner {shape.runner}'s, not {runner}'s"]
    client = _client(client)
    problems: list[str] = []
    internal = networks.one(
        client,
        shape.internal_network,
        lambda attrs: networks.internal_problems(attrs, runner, subnet=shape.subnet),
        problems,
    )
    if internal is not None and internal["Id"] != shape.internal_network_id:
        problems.append(f"network {shape.internal_network} was recreated since the shape was made")
    outward = networks.one(
        client, shape.outward_network, lambda a: networks.outward_problems(a, runner), problems
    )
    if outward is not None and outward["Id"] != shape.outward_network_id:
        problems.append(f"network {shape.outward_network} was recreated since the shape was made")
    problems += proxy.state_problems(client, shape, expected_image_id)
    problems += check_rules(shape)
    if _read(BRIDGE_NF) != "1":
        problems.append(
            f"{BRIDGE_NF} is not 1: the firewall does not see traffic between containers"
            " on one bridge (modprobe br_netfilter)"
        )
    return problems


def teardown(runner: str, *, client: docker.DockerClient | None = None) -> None:
    """Remove the runner's proxy, networks and firewall rules; IsolationError (and nothing
    removed) while a sandbox is still on the internal network."""
    check_runner(runner)
    client = _client(client)
    found = networks.named(client, internal_network_name(runner)) + networks.named(
        client, outward_network_name(runner)
    )
    for attrs in found:
        if others := networks.others_on(client, attrs, runner):
            raise IsolationError(
                f"cannot remove network {attrs['Name']}: {', '.join(others)} still on it"
            )
    proxy.remove(client, runner)
    for attrs in found:
        networks.remove(client, attrs)
    remove_rules(runner)


def resolve_image(client: docker.DockerClient, image: str) -> str:
    """The ID of a local image (never pulled)."""
    try:
        return str(client.images.get(image).id)
    except ImageNotFound as exc:
        raise IsolationError(
            f"image {image} is not on this host; build it (make egress-image) or load it"
        ) from exc
    except APIError as exc:
        raise IsolationError(f"cannot inspect image {image}: {explain(exc)}") from exc


def _client(client: docker.DockerClient | None) -> docker.DockerClient:
    if client is not None:
        return client
    try:
        return docker.from_env()
    except DockerException as exc:
        raise IsolationError(f"cannot reach the Docker engine: {exc}") from exc


def _shape(
    runner: str, image_id: str, internal: Mapping[str, Any], outward: Mapping[str, Any]
) -> Shape:
    subnet = ipaddress.IPv4Network(internal["IPAM"]["Config"][0]["Subnet"])
    return Shape(
        runner=runner,
        image_id=image_id,
        internal_network=internal["Name"],
        internal_network_id=internal["Id"],
        outward_network=outward["Name"],
        outward_network_id=outward["Id"],
        bridge=bridge_name(runner),
        subnet=str(subnet),
        gateway=str(subnet.network_address + 1),
        proxy_ip=str(subnet.network_address + 2),
        proxy_container=proxy_container_name(runner),
    )


def proxy_outward_address(shape: Shape, *, client: docker.DockerClient | None = None) -> str:
    """The proxy's address on the runner's outward network, where this host reaches it
    ('' when it has none: stopped, or gone)."""
    return proxy.outward_address(shape, _client(client))


def proxy_readiness(shape: Shape, *, client: docker.DockerClient | None = None) -> str:
    """'' when the proxy says it is ready (its /readyz: it listens, with a policy its source
    confirmed within the grace period), else what it said or why it did not answer."""
    return proxy.readiness(shape, _client(client))


# --- firewall (runners/host/firewall.py) ---------------------------------------------------


def wall(shape: Shape) -> firewall.Wall:
    """The firewall's view of a shape: its bridge, subnet and proxy."""
    return firewall.Wall(shape.runner, shape.bridge, shape.subnet, shape.proxy_ip, PROXY_PORT)


def rules(shape: Shape) -> list[firewall.Rule]:
    """The host firewall rules of a shape, in the order they must be in each chain."""
    return firewall.rules(wall(shape))


def check_rules(shape: Shape) -> list[str]:
    """What is missing or out of place among the shape's firewall rules (empty: they hold),
    once Docker's own moves have settled (firewall.settled_problems)."""
    return firewall.settled_problems(wall(shape))


def ensure_rules(shape: Shape) -> None:
    """Install the shape's firewall rules (idempotent)."""
    try:
        firewall.ensure_rules(wall(shape))
    except firewall.FirewallError as exc:
        raise IsolationError(str(exc)) from exc


def remove_rules(runner: str) -> None:
    """Remove every firewall rule of the runner; none is fine."""
    try:
        firewall.remove_rules(check_runner(runner))
    except firewall.FirewallError as exc:
        raise IsolationError(str(exc)) from exc


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
