"""Running the egress probe (checks.py) on a runner host, in the runner's real shape.

Two containers are built through the runner's engine exactly like sandboxes (same hardening,
same network options, under the name ``<runner>.probe`` so the runner's own sweep never takes
them for runs): a *peer*, standing for another agent's sandbox, which listens on a port, and
the *probe*, which tries every check at once and prints what it saw. Both are removed after.

What is tried comes from three places: the control plane's order (the agent's credentials, the
allowed vendor, an off-list name, the control plane's own services), this host's settings
(:class:`Targets`: what stands for the internet, private ranges, the metadata address, outside
resolvers, IPv6) and this host itself (every address it has, every port it listens on, the
sandbox network's gateway). No Django: runner hosts have no database.
"""

import contextlib
import functools
import ipaddress
import json
import shutil
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from allowlists.entries import split_host_port
from runners.host.containers.engine import Engine, EngineError, SandboxSpec
from runners.probe import program
from runners.probe.checks import (
    Category,
    Check,
    Expect,
    Result,
    Targets,
    failure_line,
    judge,
    observations,
    parse_address,
    parse_host_port,
    plan_json,
)
from runners.probe.checks import passed as all_passed
from runners.probe.checks import summary as summarise
from runners.protocol import ProbePlan

PEER_PORT = 8080
EMBEDDED_RESOLVER = "127.0.0.11"
MAX_HOST_CHECKS = 96  # a host listening on many ports gets its gateway tried on all, others on some
CHECK_TIMEOUT = 2.0  # seconds per connect or query (they all run at once)


@functools.cache
def _program_source() -> str:
    return Path(program.__file__).read_text()


def command(*args: str) -> list[str]:
    """The command that runs :mod:`runners.probe.program` in a container with these
    arguments: its own source, sent whole (the image has python3 and nothing of covey)."""
    return ["python3", "-c", _program_source(), *args]


class ProbeError(Exception):
    """The probe could not be run at all (not: something leaked); the message says why."""


@dataclass(frozen=True)
class Where:
    """The shape the probe runs in: its network options and the proxy sandboxes are told of."""

    network: Mapping[str, Any]  # SandboxSpec network fields (network, dns, dns_opt, sysctls)
    proxy: str  # ip:port, or "" when there is none
    gateway: str  # the host's address on the sandbox network ("" when unknown)


@dataclass
class Report:
    """One probe's results, for the control plane and for people."""

    results: list[Result]
    detail: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.detail and all_passed(self.results)

    @property
    def summary(self) -> str:
        return self.detail or summarise(self.results)


def plan(
    order: ProbePlan,
    targets: Targets,
    where: Where,
    peer: str,
    host: Sequence[tuple[str, int]],
) -> list[Check]:
    """Every check of one probe, in the order they are printed."""
    credentials = order.credentials
    no_agent = "" if credentials else (order.no_agent or "no agent to probe as")
    no_proxy = "" if where.proxy else "this runner has no proxy (COVEY_RUNNER_PROXY)"
    via = no_proxy or no_agent
    allowed_host, allowed_port = parse_host_port(order.allowed)
    off_host, off_port = parse_host_port(order.off_list)
    internet = [parse_address(t) for t in targets.internet]
    checks = [
        Check(Category.ALLOWED, "proxy", allowed_host, allowed_port, expect=Expect.REACH, skip=via),
        Check(Category.OFF_LIST, "proxy", off_host, off_port, expect=Expect.REFUSE, skip=via),
    ]
    if internet:
        address, port = internet[0]
        checks.append(
            Check(Category.RAW_IP, "proxy", address, port, expect=Expect.REFUSE, skip=via)
        )
    else:
        checks.append(_nothing(Category.RAW_IP, "proxy", "INTERNET"))
    checks += [Check(Category.INTERNET, "tcp", a, p) for a, p in internet] or [
        _nothing(Category.INTERNET, "tcp", "INTERNET")
    ]
    checks += [_tcp(Category.PRIVATE, t) for t in targets.private] or [
        _nothing(Category.PRIVATE, "tcp", "PRIVATE")
    ]
    checks += [_tcp(Category.METADATA, t) for t in targets.metadata] or [
        _nothing(Category.METADATA, "tcp", "METADATA")
    ]
    checks += [Check(Category.HOST, "tcp", a, p) for a, p in host]
    checks += [
        Check(Category.CONTROL_PLANE, "tcp", a, p)
        for a, p in control_plane_targets(list(order.services), where.gateway)
    ]
    checks.append(Check(Category.PEER, "tcp", peer, PEER_PORT))
    checks.append(Check(Category.DNS_EMBEDDED, "dns", EMBEDDED_RESOLVER, 53, allowed_host))
    resolvers = [parse_address(text, 53) for text in targets.resolvers]
    checks += [Check(Category.DNS_OUTSIDE, "dns", a, p, allowed_host) for a, p in resolvers] or [
        _nothing(Category.DNS_OUTSIDE, "dns", "RESOLVERS")
    ]
    v6 = [parse_address(t) for t in targets.ipv6] or [("", 0)]
    checks += [Check(Category.IPV6, "ipv6", a, p) for a, p in v6]
    return checks


def _nothing(category: Category, kind: str, setting: str) -> Check:
    """The line of a category this host gave nothing to try."""
    return Check(category, kind, skip=f"nothing to try: COVEY_EGRESS_PROBE_{setting} is empty")


def _tcp(category: Category, text: str) -> Check:
    address, port = parse_address(text)
    return Check(category, "tcp", address, port)


def host_targets(gateway: str, extra_ports: Sequence[int] = ()) -> list[tuple[str, int]]:
    """The runner host as a sandbox could try it: the gateway on every port the host listens
    on (whatever address it listens on: a reset would still prove the path), every other
    IPv4 address of the host on the ports listening there. At most MAX_HOST_CHECKS."""
    addresses = sorted(_host_addresses() - {gateway})
    listening: dict[int, set[str]] = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr:
            listening.setdefault(int(conn.laddr.port), set()).add(str(conn.laddr.ip))
    ports = sorted(set(listening) | set(extra_ports))
    found: list[tuple[str, int]] = [(gateway, port) for port in ports] if gateway else []
    for address in addresses:
        for port in ports:
            bound = listening.get(port, set())
            if bound & {"0.0.0.0", "::", address}:  # noqa: S104 - comparing, not binding
                found.append((address, port))
    return found[:MAX_HOST_CHECKS]


def _host_addresses() -> set[str]:
    found = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if (
                entry.family == socket.AF_INET
                and not ipaddress.ip_address(entry.address).is_loopback
            ):
                found.add(entry.address)
    return found


def control_plane_targets(services: Sequence[str], gateway: str) -> list[tuple[str, int]]:
    """Where a sandbox would find the control plane's services (``host:port`` each, as the
    control plane knows them): on this host's gateway when they are on loopback (the same
    host), else at the addresses their names have here."""
    found: list[tuple[str, int]] = []
    for text in services:
        try:
            host, port = split_host_port(str(text))
        except ValueError:
            continue
        if not host:
            continue
        if host == "localhost" or _is_loopback(host):
            if gateway:
                found.append((gateway, port))
            continue
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM):
                found.append((str(info[4][0]), port))
    return sorted(set(found))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(
    engine: Engine,
    order: ProbePlan,
    targets: Targets,
    where: Where,
    scratch: Path,
    *,
    timeout: float = 60.0,
) -> Report:
    """Run one probe: the peer, then the probe container; both are gone afterwards."""
    image = order.image
    tag = uuid.uuid4().hex[:12]
    peer_id, probe_id = f"probe-{tag}-peer", f"probe-{tag}"
    home = scratch / f"probe-{tag}"
    for stale in engine.sandboxes():  # a probe cut short (the runner was killed)
        engine.remove(stale.run_id)
    try:
        engine.launch(_spec(peer_id, image, command("peer", str(PEER_PORT)), where, home, {}))
        peer = _wait_ready(engine, peer_id, where, timeout)
        checks = plan(order, targets, where, peer, host_targets(where.gateway))
        program_plan = plan_json(checks, where.proxy, order.credentials, CHECK_TIMEOUT)
        engine.launch(
            _spec(
                probe_id,
                image,
                command("probe"),
                where,
                home,
                {"COVEY_PROBE": program_plan},
            )
        )
        done = engine.wait(probe_id, timeout=timeout)
        output = engine.logs(probe_id)
        printed = _observations(output)
        if printed is None:
            raise ProbeError(
                f"the probe container (image {image}) exited {done.exit_code} without a"
                f" report: {output.strip()[-300:] or 'no output'}"
            )
    finally:
        for run_id in (probe_id, peer_id):
            with contextlib.suppress(EngineError):
                engine.remove(run_id)
        shutil.rmtree(home, ignore_errors=True)
    results = judge(checks, observations(checks, printed))
    return Report(results, lines=[r.line() for r in results])


def check_proxy(
    engine: Engine, image: str, where: Where, scratch: Path, *, timeout: float = 30.0
) -> str:
    """Whether the proxy sandboxes are told of (``where.proxy``) answers from a container on
    the sandbox network: '' when it does, else what is wrong, as a sentence for a run's status.
    """
    host, port = split_host_port(where.proxy)
    network = where.network.get("network") or "Docker's default bridge"
    tag = uuid.uuid4().hex[:12]
    run_id, home = f"proxy-check-{tag}", scratch / f"proxy-check-{tag}"
    command_line = command("proxy-check", host, str(port))
    try:
        engine.launch(_spec(run_id, image, command_line, where, home, {}))
        done = engine.wait(run_id, timeout=timeout)
        output = engine.logs(run_id).strip()
    except (EngineError, TimeoutError) as exc:
        return f"the egress proxy at {where.proxy} could not be checked from {network}: {exc}"
    finally:
        with contextlib.suppress(EngineError):
            engine.remove(run_id)
        shutil.rmtree(home, ignore_errors=True)
    if done.exit_code == 0:
        return ""
    return (
        f"the egress proxy at {where.proxy} does not answer from {network}"
        f" ({output[-200:] or f'exit code {done.exit_code}'}): COVEY_RUNNER_PROXY must be an"
        " address sandboxes reach, such as this host's address on that network"
        " (manage.py sandbox_host_address), where the proxy listens"
    )


def _spec(
    run_id: str,
    image: str,
    command: list[str],
    where: Where,
    home: Path,
    environment: Mapping[str, str],
) -> SandboxSpec:
    return SandboxSpec(
        run_id=run_id,
        agent_id=0,
        image=image,
        command=command,
        task="covey egress probe",
        environment=dict(environment),
        home=home,
        cpus=0.5,
        memory_mb=128,
        pids=512,  # one thread per check
        timeout=120,
        **dict(where.network),
    )


def _wait_ready(engine: Engine, run_id: str, where: Where, timeout: float) -> str:
    """The peer's address once it listens."""
    deadline = time.monotonic() + timeout
    while True:
        sandbox = engine.get(run_id)
        if sandbox is None or sandbox.status in ("exited", "dead"):
            output = engine.logs(run_id) if sandbox is not None else ""
            raise ProbeError(f"the peer container stopped: {output.strip()[-300:] or 'no output'}")
        if "ready" in engine.logs(run_id):
            address = engine.address(run_id, where.network.get("network"))
            if not address:
                raise ProbeError("the peer container has no address on the sandbox network")
            return address
        if time.monotonic() >= deadline:
            raise ProbeError(f"the peer container was not ready within {timeout} s")
        time.sleep(0.05)


def _observations(output: str) -> list[Any] | None:
    for line in reversed(output.splitlines()):
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if isinstance(data, dict) and isinstance(data.get("observations"), list):
                return list(data["observations"])
    return None


def failed(detail: str) -> Report:
    """The report of a probe that could not run."""
    return Report([], detail=detail, lines=[failure_line(detail)])
