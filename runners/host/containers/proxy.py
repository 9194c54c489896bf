"""The egress proxy container of a runner's hard isolation: on both networks at a fixed
address, pinned to an image ID, its environment's digest in a label; found, checked, made,
waited for and removed here (the docker SDK), and asked whether it is ready."""

import hashlib
import http.client
import json
import socket
import time
from collections.abc import Mapping
from typing import Any

import docker
from docker.errors import APIError, NotFound
from docker.types import LogConfig

from runners.host.containers.shape import (
    LABEL_ISOLATION,
    LABEL_ROLE,
    PROXY_PORT,
    PROXY_STATUS_PORT,
    IsolationError,
    Shape,
    explain,
    proxy_container_name,
)

PROXY_STOP_SECONDS = 10  # a proxy being replaced or torn down has this long to write its log
LABEL_CONFIG = "covey.egress.config"  # hash of the proxy's environment


def inspect(client: docker.DockerClient, runner: str) -> dict[str, Any] | None:
    """The runner's proxy container, inspected; None when there is none."""
    try:
        return dict(client.api.inspect_container(proxy_container_name(runner)))
    except NotFound:
        return None


def _config_digest(environment: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(environment), sort_keys=True).encode()).hexdigest()


def state_problems(client: docker.DockerClient, shape: Shape, image_id: str) -> list[str]:
    """What is wrong with the runner's proxy (missing, not as built, not accepting
    connections); empty when nothing is."""
    attrs = inspect(client, shape.runner)
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


def ensure(
    client: docker.DockerClient, shape: Shape, environment: Mapping[str, str]
) -> dict[str, Any]:
    """The shape's proxy with this environment, running: kept when it is right, made again
    when not (IsolationError when a container of its name is not covey's)."""
    digest = _config_digest(environment)
    attrs = inspect(client, shape.runner)
    if attrs is not None:
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        if labels.get(LABEL_ISOLATION) != shape.runner:
            raise IsolationError(
                f"a container named {shape.proxy_container} exists and covey did not make it"
            )
        problems = _proxy_problems(attrs, shape, shape.image_id)
        if not problems and labels.get(LABEL_CONFIG) == digest:
            return attrs
        remove(client, shape.runner)
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
            f"cannot create the proxy {shape.proxy_container}: {explain(exc)}"
        ) from exc
    try:
        client.api.connect_container_to_network(container.id, shape.outward_network_id)
        container.start()
    except APIError as exc:
        remove(client, shape.runner)
        raise IsolationError(
            f"cannot start the proxy {shape.proxy_container}: {explain(exc)}"
        ) from exc
    attrs = inspect(client, shape.runner)
    if attrs is None or (problems := _proxy_problems(attrs, shape, shape.image_id)):
        remove(client, shape.runner)
        raise IsolationError(f"the new proxy is not right: {'; '.join(problems or ['gone'])}")
    return attrs


def remove(client: docker.DockerClient, runner: str) -> None:
    """Stop and remove the runner's proxy (none is fine); IsolationError when a container of
    its name is not covey's."""
    attrs = inspect(client, runner)
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
            raise IsolationError(f"cannot remove the proxy: {explain(exc)}") from exc


def _outward_address(attrs: Mapping[str, Any], shape: Shape) -> str:
    networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
    return str((networks.get(shape.outward_network) or {}).get("IPAddress") or "")


def outward_address(shape: Shape, client: docker.DockerClient) -> str:
    """The proxy's address on the runner's outward network, where this host reaches it
    ('' when it has none: stopped, or gone)."""
    attrs = inspect(client, shape.runner)
    return _outward_address(attrs, shape) if attrs is not None else ""


def readiness(shape: Shape, client: docker.DockerClient) -> str:
    """'' when the proxy says it is ready (its /readyz: it listens, with a policy its source
    confirmed within the grace period), else what it said or why it did not answer."""
    address = outward_address(shape, client)
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


def wait_ready(client: docker.DockerClient, shape: Shape, timeout: float) -> None:
    """Wait until the shape's proxy accepts connections; IsolationError when it stops, is
    replaced, or does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        attrs = inspect(client, shape.runner)
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
