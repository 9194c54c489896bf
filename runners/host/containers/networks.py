"""The two networks of a runner's hard isolation: the internal one sandboxes join (no route
out, no traffic between its containers, a /24 of its own from the pool) and the outward one the
proxy goes out through; found, checked, made and removed here (the docker SDK)."""

import contextlib
import hashlib
import ipaddress
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound
from docker.types import IPAMConfig, IPAMPool

from runners.host.containers import proxy
from runners.host.containers.engine import LABEL_RUNNER
from runners.host.containers.shape import (
    LABEL_ISOLATION,
    LABEL_ROLE,
    IsolationError,
    bridge_name,
    explain,
    internal_network_name,
    outward_network_name,
    proxy_container_name,
)

DEFAULT_POOL = "10.213.0.0/16"
ICC = "com.docker.network.bridge.enable_icc"
BRIDGE_NAME = "com.docker.network.bridge.name"
ROUTES = Path("/proc/net/route")


def parse_pool(pool: str) -> ipaddress.IPv4Network:
    """The subnet pool internal networks take their /24 from; ValueError when it cannot be one."""
    try:
        network = ipaddress.ip_network(pool)
    except ValueError as exc:
        raise ValueError(f"the subnet pool {pool!r} is not a network: {exc}") from None
    if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 24:
        raise ValueError(f"the subnet pool {pool} must be IPv4 and hold at least one /24")
    return network


def named(client: docker.DockerClient, name: str) -> list[dict[str, Any]]:
    """Every network with exactly this name (Docker allows several), inspected."""
    found = []
    for summary in client.api.networks(names=[name]):
        if summary["Name"] != name:  # the filter matches parts of names too
            continue
        with contextlib.suppress(NotFound):
            found.append(client.api.inspect_network(summary["Id"]))
    return found


def one(
    client: docker.DockerClient,
    name: str,
    problems_of: Any,
    problems: list[str],
) -> dict[str, Any] | None:
    """The network, when there is exactly one and it is right; otherwise say why."""
    found = named(client, name)
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


def ensure(
    client: docker.DockerClient,
    runner: str,
    name: str,
    problems_of: Any,
    create: Any,
) -> dict[str, Any]:
    """The network named ``name``, made (``create``) when missing, and made again when it is
    wrong (``problems_of``) or there are several: the proxy goes first; IsolationError while
    anything else is on it."""
    found = named(client, name)
    if len(found) == 1 and not problems_of(found[0]):
        return found[0]
    for attrs in found:
        if others := others_on(client, attrs, runner):
            wrong = "; ".join(problems_of(attrs)) or f"one of {len(found)} of that name"
            raise IsolationError(
                f"network {name} must be recreated ({wrong}) but {', '.join(others)}"
                " are on it: stop them, then try again"
            )
    if found:
        proxy.remove(client, runner)
        for attrs in found:
            remove(client, attrs)
    created: dict[str, Any] = create()
    return created


def internal_problems(
    attrs: Mapping[str, Any],
    runner: str,
    pool: ipaddress.IPv4Network | None = None,
    subnet: str | None = None,
) -> list[str]:
    """What differs between a network and the runner's internal one (in ``pool``, or on
    ``subnet``); empty when nothing does."""
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


def outward_problems(attrs: Mapping[str, Any], runner: str) -> list[str]:
    """What differs between a network and the runner's outward one; empty when nothing does."""
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


def _create(client: docker.DockerClient, name: str, runner: str, role: str, **more: Any) -> Any:
    """A bridge network without IPv6, labelled as the runner's ``role``; APIError as Docker
    refused it."""
    return client.networks.create(
        name,
        driver="bridge",
        enable_ipv6=False,
        check_duplicate=True,
        labels=_labels(runner, role),
        **more,
    )


def create_internal(
    client: docker.DockerClient, runner: str, pool: ipaddress.IPv4Network
) -> dict[str, Any]:
    """Make the runner's internal network on a free /24 of the pool; it, inspected."""
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
            options = {ICC: "false", BRIDGE_NAME: bridge_name(runner)}
            network = _create(
                client, name, runner, "internal", internal=True, options=options, ipam=ipam
            )
        except APIError as exc:
            refused = explain(exc)
            if "overlap" in refused.lower():  # taken meanwhile (another runner)
                continue
            raise IsolationError(f"cannot create network {name}: {refused}") from exc
        return dict(client.api.inspect_network(network.id))
    raise IsolationError(f"no free /24 left in the pool {pool} for {name} {refused}".strip())


def create_outward(client: docker.DockerClient, runner: str) -> dict[str, Any]:
    """Make the network the runner's proxy goes out through; it, inspected."""
    name = outward_network_name(runner)
    try:
        network = _create(client, name, runner, "outward")
    except APIError as exc:
        raise IsolationError(f"cannot create network {name}: {explain(exc)}") from exc
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


def others_on(client: docker.DockerClient, attrs: Mapping[str, Any], runner: str) -> list[str]:
    """Names of containers on a network other than the runner's own proxy."""
    names = {str(c.get("Name", "")) for c in (attrs.get("Containers") or {}).values()}
    # Containers created but not started are not on it yet, but name it: the engine's filter
    # finds them by the network's name (not by its ID).
    for summary in client.api.containers(all=True, filters={"network": attrs["Name"]}):
        if attrs["Name"] in ((summary.get("NetworkSettings") or {}).get("Networks") or {}):
            names.update(name.lstrip("/") for name in summary.get("Names") or [])
    proxy = proxy_container_name(runner)
    return sorted(name for name in names if name and name != proxy)


def remove(client: docker.DockerClient, attrs: Mapping[str, Any]) -> None:
    """Remove a network (gone already is fine)."""
    try:
        client.api.remove_network(attrs["Id"])
    except NotFound:
        pass
    except APIError as exc:
        raise IsolationError(f"cannot remove network {attrs['Name']}: {explain(exc)}") from exc
