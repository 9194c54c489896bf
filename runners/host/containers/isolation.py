"""Hard isolation (``COVEY_EGRESS_ISOLATION=network``): the egress proxy is a sandbox's only exit.

Per runner: an internal network sandboxes join (no route out), an outward network, the proxy
container on both at a fixed address, and host firewall rules (runners/host/firewall.py) for
what ``--internal`` leaves open. docs/isolation.md has the threat model and what Docker leaves
open, found on a real runner, which these rules close.

The docker SDK and the ``iptables``/``ip6tables`` commands; no Django (runner hosts have no
database). Needs root (the firewall).
"""

import contextlib
import hashlib
import http.client
import ipaddress
import json
import re
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import IPAMConfig, IPAMPool, LogConfig

from runners.host import firewall
from runners.host.containers.engine import LABEL_RUNNER

PROXY_PORT = 3128
# The proxy's /healthz, /readyz and /metrics, on its networks (a sandbox reaches PROXY_PORT
# only: the firewall drops the rest); the runner asks /readyz on the outward side.
PROXY_STATUS_PORT = 9090
PROXY_STOP_SECONDS = 10  # a proxy being replaced or torn down has this long to write its log
DEFAULT_POOL = "10.213.0.0/16"
# Labels. The proxy does not carry covey.runner: the engine treats every container with that
# label as a sandbox (Engine.sandboxes), and the runner's reconcile would remove it.
LABEL_ISOLATION = "covey.isolation"  # runner name, on the networks and the proxy
LABEL_ROLE = "covey.role"  # internal, outward, egress-proxy
LABEL_CONFIG = "covey.egress.config"  # hash of the proxy's environment
ICC = "com.docker.network.bridge.enable_icc"
BRIDGE_NAME = "com.docker.network.bridge.name"
# The sandbox's resolver upstream: its own namespace, where nothing of the host answers.
NO_RESOLVER = "0.0.0.0"  # noqa: S104 - an address to send to, not to bind
SANDBOX_DNS_OPT = ("timeout:1", "attempts:1")
SANDBOX_SYSCTLS = {
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
ROUTES = Path("/proc/net/route")

_RUNNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DANGEROUS_CAPS = frozenset({"ALL", "NET_ADMIN", "NET_RAW", "SYS_ADMIN", "CAP_NET_ADMIN"})


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


# --- names -----------------------------------------------------------------------------------


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
    network_pool = _pool(pool)
    client = _client(client)
    image_id = resolve_image(client, image)
    internal = _ensure_network(
        client,
        runner,
        internal_network_name(runner),
        lambda attrs: _internal_problems(attrs, runner, network_pool),
        lambda: _create_internal(client, runner, network_pool),
    )
    outward = _ensure_network(
        client,
        runner,
        outward_network_name(runner),
        lambda attrs: _outward_problems(attrs, runner),
        lambda: _create_outward(client, runner),
    )
    shape = _shape(runner, image_id, internal, outward)
    ensure_rules(shape)  # before the proxy, and so before any sandbox can be attached
    env = {
        **(environment or {}),
        "COVEY_CONTROL_PLANE_URL": control_plane_url,
        "COVEY_RUNNER_TOKEN": runner_token,
        "COVEY_EGRESS_STATUS_LISTEN": f"0.0.0.0:{PROXY_STATUS_PORT}",
    }
    proxy = _ensure_proxy(client, shape, env)
    shape = replace(shape, proxy_container_id=proxy["Id"])
    _wait_ready(client, shape, ready_timeout)
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
    network_pool = _pool(pool)
    client = _client(client)
    problems: list[str] = []
    internal = _one_network(
        client,
        internal_network_name(runner),
        lambda attrs: _internal_problems(attrs, runner, network_pool),
        problems,
    )
    outward = _one_network(
        client, outward_network_name(runner), lambda a: _outward_problems(a, runner), problems
    )
    if internal is None or outward is None:
        return problems
    shape = _shape(runner, image_id, internal, outward)
    return problems + _proxy_state_problems(client, shape, image_id)


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
    internal = _one_network(
        client,
        shape.internal_network,
        lambda attrs: _internal_problems(attrs, runner, subnet=shape.subnet),
        problems,
    )
    if internal is not None and internal["Id"] != shape.internal_network_id:
        problems.append(f"network {shape.internal_network} was recreated since the shape was made")
    outward = _one_network(
        client, shape.outward_network, lambda a: _outward_problems(a, runner), problems
    )
    if outward is not None and outward["Id"] != shape.outward_network_id:
        problems.append(f"network {shape.outward_network} was recreated since the shape was made")
    problems += _proxy_state_problems(client, shape, expected_image_id)
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
    networks = _networks(client, internal_network_name(runner)) + _networks(
        client, outward_network_name(runner)
    )
    for attrs in networks:
        if others := _attached_others(client, attrs, runner):
            raise IsolationError(
                f"cannot remove network {attrs['Name']}: {', '.join(others)} still on it"
            )
    _remove_proxy(client, runner)
    for attrs in networks:
        _remove_network(client, attrs)
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
        raise IsolationError(f"cannot inspect image {image}: {_explain(exc)}") from exc


def _client(client: docker.DockerClient | None) -> docker.DockerClient:
    if client is not None:
        return client
    try:
        return docker.from_env()
    except DockerException as exc:
        raise IsolationError(f"cannot reach the Docker engine: {exc}") from exc


def _pool(pool: str) -> ipaddress.IPv4Network:
    try:
        network = ipaddress.ip_network(pool)
    except ValueError as exc:
        raise ValueError(f"the subnet pool {pool!r} is not a network: {exc}") from None
    if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 24:
        raise ValueError(f"the subnet pool {pool} must be IPv4 and hold at least one /24")
    return network


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


# --- networks -------------------------------------------------------------------------------


def _networks(client: docker.DockerClient, name: str) -> list[dict[str, Any]]:
    """Every network with exactly this name (Docker allows several), inspected."""
    found = []
    for summary in client.api.networks(names=[name]):
        if summary["Name"] != name:  # the filter matches parts of names too
            continue
        with contextlib.suppress(NotFound):
            found.append(client.api.inspect_network(summary["Id"]))
    return found


def _one_network(
    client: docker.DockerClient,
    name: str,
    problems_of: Any,
    problems: list[str],
) -> dict[str, Any] | None:
    """The network, when there is exactly one and it is right; otherwise say why."""
    found = _networks(client, name)
    if not found:
        problems.append(f"network {name} is missing")
        return None
    if len(found) > 1:
        problems.append(f"there are {len(found)} networks named {name}")
        return None
    if wrong := problems_of(found[0]):
        problems.extend(f"network {name}: {problem}" for problem in wrong)
        return None
    return found[0]


def _ensure_network(
    client: docker.DockerClient,
    runner: str,
    name: str,
    problems_of: Any,
    create: Any,
) -> dict[str, Any]:
    found = _networks(client, name)
    if len(found) == 1 and not problems_of(found[0]):
        return found[0]
    for attrs in found:
        if others := _attached_others(client, attrs, runner):
            wrong = "; ".join(problems_of(attrs)) or f"one of {len(found)} of that name"
            raise IsolationError(
                f"network {name} must be recreated ({wrong}) but {', '.join(others)}"
                " are on it: stop them, then try again"
            )
    if found:
        _remove_proxy(client, runner)
        for attrs in found:
            _remove_network(client, attrs)
    created: dict[str, Any] = create()
    return created


def _internal_problems(
    attrs: Mapping[str, Any],
    runner: str,
    pool: ipaddress.IPv4Network | None = None,
    subnet: str | None = None,
) -> list[str]:
    problems = _common_problems(attrs, runner, "internal")
    if not attrs.get("Internal"):
        problems.append("it is not internal")
    options = attrs.get("Options") or {}
    if options.get(ICC) != "false":
        problems.append("communication between its containers (ICC) is not off")
    if options.get(BRIDGE_NAME) != bridge_name(runner):
        problems.append(f"its bridge is not named {bridge_name(runner)}")
    configs = (attrs.get("IPAM") or {}).get("Config") or []
    if len(configs) != 1:
        problems.append(f"it has {len(configs)} address pools, not one")
        return problems
    try:
        network = ipaddress.IPv4Network(configs[0].get("Subnet", ""))
    except ValueError:
        problems.append(f"its subnet {configs[0].get('Subnet')!r} is not an IPv4 network")
        return problems
    if network.prefixlen != 24:
        problems.append(f"its subnet {network} is not a /24")
        return problems
    if pool is not None and not network.subnet_of(pool):
        problems.append(f"its subnet {network} is outside the pool {pool}")
    if subnet is not None and str(network) != subnet:
        problems.append(f"its subnet is {network}, not {subnet}")
    if configs[0].get("Gateway") != str(network.network_address + 1):
        problems.append(f"its gateway is {configs[0].get('Gateway')}, not .1")
    if configs[0].get("IPRange") != str(_sandbox_range(network)):
        problems.append(f"sandboxes may take addresses outside {_sandbox_range(network)}")
    return problems


def _outward_problems(attrs: Mapping[str, Any], runner: str) -> list[str]:
    problems = _common_problems(attrs, runner, "outward")
    if attrs.get("Internal"):
        problems.append("it is internal: the proxy could not go out")
    return problems


def _common_problems(attrs: Mapping[str, Any], runner: str, role: str) -> list[str]:
    problems = []
    if attrs.get("Driver") != "bridge":
        problems.append(f"its driver is {attrs.get('Driver')}, not bridge")
    if attrs.get("EnableIPv6"):
        problems.append("it has IPv6")
    labels = attrs.get("Labels") or {}
    wanted = {LABEL_RUNNER: runner, LABEL_ISOLATION: runner, LABEL_ROLE: role}
    if any(labels.get(key) != value for key, value in wanted.items()):
        problems.append("covey did not make it (labels)")
    return problems


def _sandbox_range(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    """Where Docker gives sandboxes addresses: the upper half, away from the proxy's .2."""
    return ipaddress.IPv4Network((subnet.network_address + 128, 25))


def _labels(runner: str, role: str) -> dict[str, str]:
    return {LABEL_RUNNER: runner, LABEL_ISOLATION: runner, LABEL_ROLE: role}


def _create_internal(
    client: docker.DockerClient, runner: str, pool: ipaddress.IPv4Network
) -> dict[str, Any]:
    name = internal_network_name(runner)
    taken = _taken_subnets(client)
    refused = ""
    for subnet in _candidates(runner, pool):
        if any(subnet.overlaps(other) for other in taken):
            continue
        ipam = IPAMConfig(
            pool_configs=[
                IPAMPool(
                    subnet=str(subnet),
                    iprange=str(_sandbox_range(subnet)),
                    gateway=str(subnet.network_address + 1),
                )
            ]
        )
        try:
            network = client.networks.create(
                name,
                driver="bridge",
                internal=True,
                enable_ipv6=False,
                check_duplicate=True,
                labels=_labels(runner, "internal"),
                options={ICC: "false", BRIDGE_NAME: bridge_name(runner)},
                ipam=ipam,
            )
        except APIError as exc:
            refused = _explain(exc)
            if "overlap" in refused.lower():  # taken meanwhile (another runner)
                continue
            raise IsolationError(f"cannot create network {name}: {refused}") from exc
        return dict(client.api.inspect_network(network.id))
    raise IsolationError(f"no free /24 left in the pool {pool} for {name} {refused}".strip())


def _create_outward(client: docker.DockerClient, runner: str) -> dict[str, Any]:
    name = outward_network_name(runner)
    try:
        network = client.networks.create(
            name,
            driver="bridge",
            enable_ipv6=False,
            check_duplicate=True,
            labels=_labels(runner, "outward"),
        )
    except APIError as exc:
        raise IsolationError(f"cannot create network {name}: {_explain(exc)}") from exc
    return dict(client.api.inspect_network(network.id))


def _candidates(runner: str, pool: ipaddress.IPv4Network) -> list[ipaddress.IPv4Network]:
    """The pool's /24s, starting at one picked by the runner's name, so a runner tends to get
    the same one back."""
    subnets = list(pool.subnets(new_prefix=24))
    start = int(hashlib.sha256(runner.encode()).hexdigest(), 16) % len(subnets)
    return subnets[start:] + subnets[:start]


def _taken_subnets(client: docker.DockerClient) -> list[ipaddress.IPv4Network]:
    """Subnets of every Docker network and every route of the host but the default one."""
    taken = []
    for summary in client.api.networks():
        for config in (summary.get("IPAM") or {}).get("Config") or []:
            with contextlib.suppress(ValueError):
                network = ipaddress.ip_network(config.get("Subnet", ""), strict=False)
                if isinstance(network, ipaddress.IPv4Network):
                    taken.append(network)
    return taken + _host_routes()


def _host_routes() -> list[ipaddress.IPv4Network]:
    routes = []
    with contextlib.suppress(OSError):
        for line in ROUTES.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            destination, mask = (struct.pack("<I", int(fields[i], 16)) for i in (1, 7))
            if mask == b"\0\0\0\0":
                continue  # the default route overlaps everything
            with contextlib.suppress(ValueError):
                routes.append(
                    ipaddress.IPv4Network(
                        (socket.inet_ntoa(destination), socket.inet_ntoa(mask)), strict=False
                    )
                )
    return routes


def _attached_others(
    client: docker.DockerClient, attrs: Mapping[str, Any], runner: str
) -> list[str]:
    """Names of containers on a network other than the runner's own proxy."""
    names = {str(c.get("Name", "")) for c in (attrs.get("Containers") or {}).values()}
    # Containers created but not started are not on it yet, but name it: the engine's filter
    # finds them by the network's name (not by its ID).
    for summary in client.api.containers(all=True, filters={"network": attrs["Name"]}):
        if attrs["Name"] in ((summary.get("NetworkSettings") or {}).get("Networks") or {}):
            names.update(name.lstrip("/") for name in summary.get("Names") or [])
    proxy = proxy_container_name(runner)
    return sorted(name for name in names if name and name != proxy)


def _remove_network(client: docker.DockerClient, attrs: Mapping[str, Any]) -> None:
    try:
        client.api.remove_network(attrs["Id"])
    except NotFound:
        pass
    except APIError as exc:
        raise IsolationError(f"cannot remove network {attrs['Name']}: {_explain(exc)}") from exc


# --- the proxy ------------------------------------------------------------------------------


def _proxy(client: docker.DockerClient, runner: str) -> dict[str, Any] | None:
    try:
        return dict(client.api.inspect_container(proxy_container_name(runner)))
    except NotFound:
        return None


def _config_digest(environment: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(environment), sort_keys=True).encode()).hexdigest()


def _proxy_state_problems(client: docker.DockerClient, shape: Shape, image_id: str) -> list[str]:
    attrs = _proxy(client, shape.runner)
    if attrs is None:
        return [f"the proxy container {shape.proxy_container} is missing"]
    problems = _proxy_problems(attrs, shape, image_id)
    if not problems and not _listening(attrs, shape):
        problems.append(f"the proxy does not accept connections on port {PROXY_PORT}")
    return problems


def _proxy_problems(attrs: Mapping[str, Any], shape: Shape, image_id: str) -> list[str]:
    """What differs between a proxy container and the one :func:`ensure_shape` runs."""
    problems = []
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    if labels.get(LABEL_ISOLATION) != shape.runner or labels.get(LABEL_ROLE) != "egress-proxy":
        problems.append(f"{shape.proxy_container} is not covey's proxy (labels)")
    status = (attrs.get("State") or {}).get("Status")
    if status != "running":
        problems.append(f"the proxy is {status}, not running")
    if attrs.get("Image") != image_id:
        problems.append(f"the proxy runs image {attrs.get('Image')}, not the pinned {image_id}")
    host = attrs.get("HostConfig") or {}
    if not host.get("ReadonlyRootfs"):
        problems.append("the proxy's root file system is writable")
    if host.get("Privileged") or "ALL" not in (host.get("CapDrop") or []) or host.get("CapAdd"):
        problems.append("the proxy keeps capabilities")
    if not host.get("Init"):
        problems.append("the proxy runs without an init process")
    if "no-new-privileges" not in (host.get("SecurityOpt") or []):
        problems.append("the proxy may gain privileges (no-new-privileges is off)")
    if (host.get("RestartPolicy") or {}).get("Name") != "unless-stopped":
        problems.append("the proxy's restart policy is not unless-stopped")
    networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
    wanted = {shape.internal_network, shape.outward_network}
    if set(networks) != wanted:
        problems.append(
            f"the proxy is on {', '.join(sorted(networks)) or 'no network'},"
            f" not on {' and '.join(sorted(wanted))}"
        )
        return problems
    internal, outward = networks[shape.internal_network], networks[shape.outward_network]
    if status == "running":
        if internal.get("NetworkID") != shape.internal_network_id:
            problems.append(f"the proxy is on an older {shape.internal_network}")
        if outward.get("NetworkID") != shape.outward_network_id:
            problems.append(f"the proxy is on an older {shape.outward_network}")
        if internal.get("IPAddress") != shape.proxy_ip:
            problems.append(f"the proxy is at {internal.get('IPAddress')}, not {shape.proxy_ip}")
    return problems


def _ensure_proxy(
    client: docker.DockerClient, shape: Shape, environment: Mapping[str, str]
) -> dict[str, Any]:
    digest = _config_digest(environment)
    attrs = _proxy(client, shape.runner)
    if attrs is not None:
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        if labels.get(LABEL_ISOLATION) != shape.runner:
            raise IsolationError(
                f"a container named {shape.proxy_container} exists and covey did not make it"
            )
        problems = _proxy_problems(attrs, shape, shape.image_id)
        if not problems and labels.get(LABEL_CONFIG) == digest:
            return attrs
        _remove_proxy(client, shape.runner)
    return _create_proxy(client, shape, environment, digest)


def _create_proxy(
    client: docker.DockerClient, shape: Shape, environment: Mapping[str, str], digest: str
) -> dict[str, Any]:
    endpoint = client.api.create_endpoint_config(ipv4_address=shape.proxy_ip)
    try:
        container = client.containers.create(
            shape.image_id,
            name=shape.proxy_container,
            hostname=shape.proxy_container,  # the proxy's name in the decision log
            labels={
                LABEL_ISOLATION: shape.runner,
                LABEL_ROLE: "egress-proxy",
                LABEL_CONFIG: digest,
            },
            environment=dict(environment),
            read_only=True,
            init=True,  # signals reach the proxy, whatever its image has for PID 1
            tmpfs={"/tmp": ""},  # noqa: S108 - the container's own (COVEY_VAR_DIR)
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            restart_policy={"Name": "unless-stopped"},
            network=shape.internal_network,
            networking_config={shape.internal_network: endpoint},
            # A control plane on this host is reachable as host.docker.internal (outward side).
            extra_hosts={"host.docker.internal": "host-gateway"},
            log_config=LogConfig(
                type=LogConfig.types.JSON, config={"max-size": "10m", "max-file": "2"}
            ),
        )
    except APIError as exc:
        raise IsolationError(
            f"cannot create the proxy {shape.proxy_container}: {_explain(exc)}"
        ) from exc
    try:
        client.api.connect_container_to_network(container.id, shape.outward_network_id)
        container.start()
    except APIError as exc:
        _remove_proxy(client, shape.runner)
        raise IsolationError(
            f"cannot start the proxy {shape.proxy_container}: {_explain(exc)}"
        ) from exc
    attrs = _proxy(client, shape.runner)
    if attrs is None or (problems := _proxy_problems(attrs, shape, shape.image_id)):
        _remove_proxy(client, shape.runner)
        raise IsolationError(f"the new proxy is not right: {'; '.join(problems or ['gone'])}")
    return attrs


def _remove_proxy(client: docker.DockerClient, runner: str) -> None:
    attrs = _proxy(client, runner)
    if attrs is None:
        return
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    if labels.get(LABEL_ISOLATION) != runner:
        raise IsolationError(
            f"a container named {proxy_container_name(runner)} exists and covey did not make it"
        )
    try:
        # Stopped first (SIGTERM): the proxy writes what it decided and says it stopped, so its
        # session in the decision log ends whole, not lost. Killed after PROXY_STOP_SECONDS.
        if (attrs.get("State") or {}).get("Running"):
            client.api.stop(attrs["Id"], timeout=PROXY_STOP_SECONDS)
        client.api.remove_container(attrs["Id"], force=True)
    except NotFound:
        pass
    except APIError as exc:
        if exc.status_code != 409:  # a removal already in progress
            raise IsolationError(f"cannot remove the proxy: {_explain(exc)}") from exc


def _outward_address(attrs: Mapping[str, Any], shape: Shape) -> str:
    networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
    return str((networks.get(shape.outward_network) or {}).get("IPAddress") or "")


def proxy_outward_address(shape: Shape, *, client: docker.DockerClient | None = None) -> str:
    """The proxy's address on the runner's outward network, where this host reaches it
    ('' when it has none: stopped, or gone)."""
    attrs = _proxy(_client(client), shape.runner)
    return _outward_address(attrs, shape) if attrs is not None else ""


def proxy_readiness(shape: Shape, *, client: docker.DockerClient | None = None) -> str:
    """'' when the proxy says it is ready (its /readyz: it listens, with a policy its source
    confirmed within the grace period), else what it said or why it did not answer."""
    address = proxy_outward_address(shape, client=client)
    if not address:
        return "the proxy has no address on its outward network (stopped?)"
    connection = http.client.HTTPConnection(address, PROXY_STATUS_PORT, timeout=2)
    try:
        connection.request("GET", "/readyz")
        response = connection.getresponse()
        said = response.read(4096)
    except (OSError, http.client.HTTPException) as exc:
        return f"the proxy's /readyz did not answer ({address}:{PROXY_STATUS_PORT}): {exc}"
    finally:
        connection.close()
    if response.status == 200:
        return ""
    try:
        checks = json.loads(said)["checks"]
        why = "; ".join(f"{name}: {answer}" for name, answer in checks.items() if answer != "ok")
    except (ValueError, KeyError, TypeError, AttributeError):
        why = said[:200].decode(errors="replace")
    return f"the proxy is not ready ({why or response.status})"


def _listening(attrs: Mapping[str, Any], shape: Shape) -> bool:
    """Whether the proxy accepts a connection (tried from the host, on the outward side:
    the host's own packets from the internal bridge are dropped)."""
    address = _outward_address(attrs, shape)
    if not address:
        return False
    try:
        socket.create_connection((address, PROXY_PORT), timeout=1).close()
    except OSError:
        return False
    return True


def _wait_ready(client: docker.DockerClient, shape: Shape, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        attrs = _proxy(client, shape.runner)
        if attrs is not None and attrs.get("Id") != shape.proxy_container_id:
            # Removed, and its name taken by another container: waiting would wait for that.
            raise IsolationError(
                f"the proxy container went while it started, and another now has its name"
                f" ({proxy_container_name(shape.runner)})"
            )
        status = ((attrs or {}).get("State") or {}).get("Status")
        if attrs is None or status not in ("running", "restarting", "created"):
            raise IsolationError(f"the proxy stopped ({status}): {_logs(client, shape)}")
        if _listening(attrs, shape):
            return
        if time.monotonic() >= deadline:
            raise IsolationError(
                f"the proxy did not accept connections within {timeout} s: {_logs(client, shape)}"
            )
        time.sleep(0.2)


def _logs(client: docker.DockerClient, shape: Shape) -> str:
    try:
        output = client.api.logs(shape.proxy_container, tail=20)
    except (APIError, NotFound):
        return "no logs"
    return bytes(output).decode("utf-8", errors="replace").strip() or "no output"


# --- firewall (runners/host/firewall.py) ---------------------------------------------------


def wall(shape: Shape) -> firewall.Wall:
    return firewall.Wall(shape.runner, shape.bridge, shape.subnet, shape.proxy_ip, PROXY_PORT)


def rules(shape: Shape) -> list[firewall.Rule]:
    """The host firewall rules of a shape, in the order they must be in each chain."""
    return firewall.rules(wall(shape))


def check_rules(shape: Shape) -> list[str]:
    """What is missing or out of place among the shape's firewall rules (empty: they hold)."""
    return firewall.check_rules(wall(shape))


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


def _explain(exc: APIError) -> str:
    return str(exc.explanation or exc)
