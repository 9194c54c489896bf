"""The egress probe against the real thing: a runner's isolation shape (networks, firewall,
the proxy container from `make egress-image`) reading policy from a real control plane, and
stand-ins for the outside world (tests/runners/test_isolated_runs.py: Outside, the upstream
and its DNS server). Every hole is made deliberately, on this machine's own firewall or in the
sandbox's options, and the probe must name it; no packet goes anywhere but this machine.

The probe runs from this process through runners/probe/host.py (the runner host's own code) with
an order from the control plane's runner API, and reports back through it.
"""

import contextlib
import json
import subprocess
from collections.abc import Iterator
from uuid import uuid4

import pytest

from agents import services as agent_services
from agents.models import Agent
from egress.environment import Isolation
from egress.models import Decision
from organisations.models import Organisation
from runners.host import runner as host_module
from runners.host import trust
from runners.host.client import ControlPlaneClient
from runners.host.containers import isolation
from runners.host.containers.engine import Engine
from runners.host.identity import Identity, docker_name
from runners.models import Probe, ProbeStatus, Runner
from runners.probe import host as probing
from runners.probe.checks import Category, Check, Expect, Result, Verdict, judge, parse_address
from runners.protocol import ProbePlan
from runners.services import installation_key
from tests.runners.world import UPSTREAM_NAME, World, runner_ids_apart
from tests.workers import FIREWALL

# The module's rows are committed once (the control plane is another process); a test's own
# writes roll back. The mark also makes pytest-django create the test database when only these
# tests are selected.
pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

SESSION = uuid4().hex[:8]
HOLE = f"covey-test-hole-{SESSION}"


# --- pure -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seen", "verdict"),
    [
        ({"outcome": "timeout"}, Verdict.OK),
        ({"outcome": "unreachable", "detail": "Network is unreachable"}, Verdict.OK),
        ({"outcome": "connected"}, Verdict.LEAK),
        ({"outcome": "refused"}, Verdict.LEAK),  # a reset came back: packets got there
        ({"error": "boom"}, Verdict.FAIL),
        ({"outcome": "odd"}, Verdict.FAIL),
    ],
)
def test_a_direct_connect_is_blocked_only_when_nothing_came_back(seen, verdict):
    [result] = judge([Check(Category.INTERNET, "tcp", "192.0.2.1", 443)], [seen])
    assert result.verdict is verdict


@pytest.mark.parametrize(
    ("expect", "seen", "verdict"),
    [
        (Expect.REACH, {"outcome": "answered", "status": 200, "upstream": "ok"}, Verdict.OK),
        (Expect.REACH, {"outcome": "answered", "status": 403, "deny_reason": "x"}, Verdict.FAIL),
        (Expect.REACH, {"outcome": "answered", "status": 200, "upstream": "TLS…"}, Verdict.FAIL),
        (
            Expect.REFUSE,
            {"outcome": "answered", "status": 403, "deny_reason": "ip-literal"},
            Verdict.OK,
        ),
        (Expect.REFUSE, {"outcome": "answered", "status": 200}, Verdict.LEAK),
        (Expect.REFUSE, {"outcome": "answered", "status": 502, "deny_reason": ""}, Verdict.FAIL),
        (Expect.REFUSE, {"outcome": "unreachable"}, Verdict.FAIL),
    ],
)
def test_through_the_proxy_only_covey_s_own_refusal_counts(expect, seen, verdict):
    [result] = judge([Check(Category.OFF_LIST, "proxy", "a.test", 443, expect=expect)], [seen])
    assert result.verdict is verdict, result


def test_dns_and_ipv6_verdicts():
    embedded = Check(Category.DNS_EMBEDDED, "dns", "127.0.0.11", 53, "a.test")
    outside = Check(Category.DNS_OUTSIDE, "dns", "192.0.2.53", 53, "a.test")
    v6 = Check(Category.IPV6, "ipv6", "fd00::1", 443)
    nxdomain = {"outcome": "reply", "rcode": 3, "answers": 0}
    answered = {"outcome": "reply", "rcode": 0, "answers": 1}
    verdicts = [
        r.verdict
        for r in judge(
            [embedded, embedded, outside, outside, v6, v6],
            [
                nxdomain,
                answered,
                {"outcome": "timeout"},
                nxdomain,
                {"addresses": [], "outcome": "unreachable"},
                {"addresses": ["fe80::1%eth0"]},
            ],
        )
    ]
    assert verdicts == [
        Verdict.OK,
        Verdict.LEAK,
        Verdict.OK,
        Verdict.LEAK,
        Verdict.OK,
        Verdict.LEAK,
    ]


def test_a_missing_observation_fails_and_a_skipped_check_says_why():
    checks = [
        Check(Category.ALLOWED, "proxy", "a.test", 443, expect=Expect.REACH, skip="no agent"),
        Check(Category.PEER, "tcp", "10.0.0.2", 8080),
    ]
    skipped, missing = judge(checks, [{}, None])
    assert (skipped.verdict, skipped.observed) == (Verdict.SKIP, "no agent")
    assert missing.verdict is Verdict.FAIL


@pytest.mark.parametrize("text", ["example.com:443", "10.0.0.1", "10.0.0.1:0", "[::1", "1.2.3.4:x"])
def test_probe_targets_must_be_addresses_with_ports(text):
    with pytest.raises(ValueError, match=r"port|IP address"):
        parse_address(text)


def test_parse_address_takes_ipv6_in_brackets():
    assert parse_address("[fd00::1]:443") == ("fd00::1", 443)
    assert parse_address("10.0.0.53", 53) == ("10.0.0.53", 53)


def test_results_round_trip_and_print_one_line_each():
    result = Result("host", "tcp 10.0.0.1:22", Verdict.LEAK, "connected")
    assert Result.from_dict(result.as_dict()) == result
    assert result.line().split() == ["LEAK", "host", "tcp", "10.0.0.1:22", "connected"]


def test_a_category_with_nothing_to_try_says_so():
    where = probing.Where(network={}, proxy="10.0.0.2:3128", gateway="10.0.0.1")
    order = ProbePlan(
        probe="p", allowed="vendor.test:443", off_list="off.test", credentials="a.b:c"
    )
    empty = probing.Targets(internet=(), private=(), metadata=(), resolvers=(), ipv6=())

    checks = probing.plan(order, empty, where, "10.0.0.130", [("10.0.0.1", 22)])

    skipped = {c.category.value: c.skip for c in checks if c.skip}
    assert set(skipped) == {"raw-ip", "internet", "private", "metadata", "dns-outside"}
    assert skipped["private"] == "nothing to try: COVEY_EGRESS_PROBE_PRIVATE is empty"
    assert [c.target for c in checks if c.category == "internet"] == ["tcp (nothing)"]
    tried = [c.category.value for c in checks if not c.skip]
    assert tried == [
        "allowed", "off-list", "host", "peer", "dns-embedded", "ipv6",
    ]  # fmt: skip


def test_a_probe_that_cannot_reach_the_control_plane_is_tried_again_soon(tmp_path):
    config = tmp_path / "runner.json"  # a control plane where nothing listens
    config.write_text(json.dumps({"url": "http://127.0.0.1:9", "id": 7, "name": "e", "token": "t"}))
    identity = Identity(config)
    settings = host_module.HostSettings(
        homes=tmp_path, isolation=Isolation.NETWORK, probe_retry=300
    )
    now = [1000.0]
    runner_host = host_module.RunnerHost({7: identity}, settings, clock=lambda: now[0])
    assert runner_host.trust.due(identity)  # never probed

    assert runner_host.start_probes() == {7: None}

    assert not runner_host.trust.due(identity)  # not again at every poll
    with pytest.raises(host_module.UntrustedError, match="the probe could not run: "):
        runner_host.trust.require(identity, proxied=False)  # and no work meanwhile
    now[0] += trust.UNREPORTED_RETRY_SECONDS
    assert runner_host.trust.due(identity)  # soon, not after probe_retry


# --- the real shape -------------------------------------------------------------------------


class ProbeWorld:
    """The module's control plane, stand-ins, registered runner and its shape."""

    def __init__(self, world: World, runner: Runner, token: str, shape: isolation.Shape) -> None:
        self.world, self.runner, self.token, self.shape = world, runner, token, shape
        self.name = docker_name(runner.pk, installation_key())
        self.client = ControlPlaneClient(world.stack.url, token)
        self.engine = Engine(f"{self.name}.probe", installation=installation_key())

    def ensure_shape(self) -> None:
        env = self.world.runner_env()
        self.shape = isolation.ensure_shape(
            self.name,
            self.world.proxy_image,
            env["COVEY_RUNNER_PROXY_CONTROL_PLANE_URL"],
            self.token,
            environment={
                key: env[key]
                for key in ("COVEY_EGRESS_NAMESERVERS", "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS")
            },
            ready_timeout=30,
        )

    def where(self, **network_changes) -> probing.Where:
        return probing.Where(
            network={**isolation.sandbox_network_options(self.shape), **network_changes},
            proxy=isolation.proxy_address(self.shape),
            gateway=self.shape.gateway,
        )

    def targets(self) -> probing.Targets:
        env = self.world.outside.targets()
        return probing.Targets(
            internet=[env["COVEY_EGRESS_PROBE_INTERNET"]],
            private=[env["COVEY_EGRESS_PROBE_PRIVATE"]],
            metadata=[env["COVEY_EGRESS_PROBE_METADATA"]],
            resolvers=[env["COVEY_EGRESS_PROBE_RESOLVERS"]],
            ipv6=[env["COVEY_EGRESS_PROBE_IPV6"]],
        )

    def probe(self, where: probing.Where | None = None) -> probing.Report:
        """One probe, as the runner host runs it: ordered by the control plane, reported back."""
        order = self.client.begin_probe(None, Isolation.NETWORK, "test")
        assert order is not None and not order.error, order
        report = probing.run(
            self.engine, order, self.targets(), where or self.where(), self.world.stack.tmp
        )
        self.client.report_probe(order.probe, report.results, report.detail)
        return report


def leaks(report: probing.Report) -> set[str]:
    return {r.category for r in report.results if r.verdict is Verdict.LEAK}


def verdicts(report: probing.Report) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for r in report.results:
        found.setdefault(r.category, set()).add(r.verdict.value)
    return found


@pytest.fixture(scope="module")
def world(
    django_db_setup,
    django_db_blocker,
    tmp_path_factory,
    base_image,
    egress_image,
) -> Iterator[ProbeWorld]:
    """Committed rows the control plane (another process) reads; deleted when done (only
    these: the shipped templates, from a data migration, must stay)."""
    with django_db_blocker.unblock(), FIREWALL.shared():  # the shape's rules, as covey left them
        runner_ids_apart()
        built = World(tmp_path_factory.mktemp("probe"), base_image, egress_image)
        organisation = Organisation.objects.create(name="Probed", slug="probed")
        try:
            agent_services.create_agent(organisation, "Prober", allowlist=[f"{UPSTREAM_NAME}:80"])
            runner, config = built.register(organisation, "probed-1")
            token = json.loads(config.read_text())["token"]
            probe_world = ProbeWorld(built, runner, token, None)  # type: ignore[arg-type]
            probe_world.ensure_shape()
            yield probe_world
        finally:
            try:
                built.close()
            finally:
                Decision.objects.filter(agent__organisation=organisation).delete()
                Runner.objects.filter(organisation=organisation).delete()  # and their probes
                Agent.objects.filter(organisation=organisation).delete()  # and their tokens
                organisation.delete()


@contextlib.contextmanager
def rules(*specs: tuple[str, ...]) -> Iterator[None]:
    """Firewall rules put ahead of everything (each its chain's first), removed after."""
    tag = ("-m", "comment", "--comment", HOLE)
    inserted = []
    with FIREWALL.exclusive():  # no other test process sees the hole (tests/workers.py)
        try:
            for chain, *spec in specs:
                args = [chain, "1", *spec, *tag, "-j", "ACCEPT"]
                subprocess.run(["iptables", "-w", "10", "-I", *args], check=True)
                inserted.append([chain, *spec, *tag, "-j", "ACCEPT"])
            yield
        finally:
            for args in inserted:
                subprocess.run(["iptables", "-w", "10", "-D", *args], check=False)


def to_and_from(bridge: str, address: str, protocol: str, port: int) -> list[tuple[str, ...]]:
    """A path through the host between the sandbox network and one address and port."""
    return [
        ("DOCKER-USER", "-i", bridge, "-d", address, "-p", protocol, "--dport", str(port)),
        ("DOCKER-USER", "-o", bridge, "-s", address, "-p", protocol, "--sport", str(port)),
    ]


@pytest.mark.docker
def test_the_shape_as_built_passes_every_check(world):
    report = world.probe()

    assert report.passed, "\n".join(report.lines)
    seen = verdicts(report)
    assert set(seen) == {c.value for c in Category}
    assert all(v == {"ok"} for v in seen.values()), seen
    stored = Probe.objects.filter(runner=world.runner).order_by("-created_at").first()
    assert stored is not None and stored.status == ProbeStatus.PASSED, stored
    assert len(stored.checks) == len(report.results)


# Each hole opens one path (and only as wide as that path), the probe must name it, and every
# other category must still hold. A hole's firewall rules go first in their chain, as an
# administrator's (or another tool's) rule would.


def holes(world: ProbeWorld) -> dict[str, tuple[list[tuple[str, ...]], set[str]]]:
    """Firewall holes: the rules, and the categories that must then leak."""
    bridge, outside = world.shape.bridge, world.world.outside
    internet, lan = outside.internet, outside.lan
    broker_port = "56379"  # the test Redis, on loopback: a reset from the host still leaks
    return {
        "internet": (to_and_from(bridge, internet, "tcp", 443), {"internet"}),
        "private": (to_and_from(bridge, lan, "tcp", 8080), {"private"}),
        "metadata": (to_and_from(bridge, lan, "tcp", 80), {"metadata"}),
        "host": ([("INPUT", "-i", bridge)], {"host", "control-plane"}),
        "control-plane": (
            [("INPUT", "-i", bridge, "-p", "tcp", "--dport", broker_port)],
            {"host", "control-plane"},
        ),
        "peer": ([("DOCKER-USER", "-i", bridge, "-o", bridge)], {"peer"}),
        "dns-outside": (to_and_from(bridge, internet, "udp", 53), {"dns-outside"}),
    }


@pytest.mark.docker
@pytest.mark.parametrize(
    "hole", ["internet", "private", "metadata", "host", "control-plane", "peer", "dns-outside"]
)
def test_a_hole_in_the_firewall_is_named_by_the_probe(world, hole):
    specs, expected = holes(world)[hole]

    with rules(*specs):
        report = world.probe()

    assert not report.passed
    assert leaks(report) == expected, "\n".join(report.lines)
    assert world.probe().passed  # closed again


@pytest.mark.docker
def test_a_sandbox_given_an_outside_resolver_is_caught_by_the_embedded_dns_check(world):
    # Docker's resolver forwards what it does not know to the sandbox's --dns servers, from
    # the sandbox's own namespace: with a resolver named and a path to it, names resolve.
    internet = world.world.outside.internet
    with rules(*to_and_from(world.shape.bridge, internet, "udp", 53)):
        report = world.probe(world.where(dns=[internet]))

    assert leaks(report) == {"dns-embedded", "dns-outside"}, "\n".join(report.lines)


@pytest.mark.docker
def test_a_sandbox_with_ipv6_on_is_caught(world):
    report = world.probe(
        world.where(
            sysctls={
                "net.ipv6.conf.all.disable_ipv6": "0",
                "net.ipv6.conf.default.disable_ipv6": "0",
            }
        )
    )

    assert leaks(report) == {"ipv6"}, "\n".join(report.lines)
    [line] = [r for r in report.results if r.category == "ipv6"]
    assert "fe80:" in line.observed  # the link-local address the kernel gave eth0


@pytest.mark.docker
def test_a_sandbox_on_a_second_network_is_caught(world):
    # A sandbox also attached to the LAN (what the preflight's network check refuses) reaches
    # it directly; the probe finds out without asking the preflight.
    lan = world.world.outside.lan_network
    report = world.probe(world.where(network=lan))

    assert {"private", "metadata"} <= leaks(report), "\n".join(report.lines)


IMPOSTOR = r"""
import socket, sys, threading
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
def handle(client):
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = client.recv(4096)
        if not chunk:
            return
        head += chunk
    method, target = head.split(b" ")[:2]
    if method != b"CONNECT":
        client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return client.close()
    host, _, port = target.decode().rpartition(":")
    try:
        upstream = socket.create_connection((sys.argv[1], int(port)), timeout=5)
    except OSError:
        client.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
        return client.close()
    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
    threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
    pipe(client, upstream)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 3128))
s.listen(64)
print("ready", flush=True)
while True:
    threading.Thread(target=handle, args=(s.accept()[0],), daemon=True).start()
"""


@pytest.mark.docker
def test_a_permissive_proxy_in_the_proxys_place_is_caught(world, base_image):
    # Something else answers at the proxy's address (the pinned image is not running): it
    # tunnels to whatever it is asked for, sending every name to the internet stand-in.
    shape = world.shape
    impostor = f"covey-test-impostor-{SESSION}"
    subprocess.run(["docker", "rm", "--force", shape.proxy_container], check=True)
    try:
        subprocess.run(
            ["docker", "create", "--name", impostor, "--label", f"covey.test=probe-{SESSION}",
             "--network", shape.internal_network, "--ip", shape.proxy_ip,
             base_image, "python3", "-c", IMPOSTOR, world.world.outside.internet],
            check=True, capture_output=True,
        )  # fmt: skip
        subprocess.run(["docker", "network", "connect", "bridge", impostor], check=True)
        subprocess.run(["docker", "start", impostor], check=True, capture_output=True)
        report = world.probe()
    finally:
        subprocess.run(["docker", "rm", "--force", impostor], capture_output=True)
        world.ensure_shape()

    assert leaks(report) == {"off-list", "raw-ip"}, "\n".join(report.lines)
    assert world.probe().passed


@pytest.mark.docker
def test_a_proxy_that_is_down_fails_the_allowed_check(world):
    subprocess.run(["docker", "stop", "--time", "1", world.shape.proxy_container], check=True)
    try:
        report = world.probe()
    finally:
        world.ensure_shape()

    assert not report.passed and leaks(report) == set(), "\n".join(report.lines)
    failed = {r.category for r in report.results if r.verdict is Verdict.FAIL}
    assert failed == {"allowed", "off-list", "raw-ip"}, "\n".join(report.lines)


@pytest.mark.docker
def test_cooperative_mode_is_bypassed_and_the_same_bypass_fails_under_isolation(world):
    # Cooperative: the sandbox is on Docker's default bridge (no COVEY_RUNNER_NETWORK) and
    # only told of the proxy. A process that ignores the proxy variables connects straight to
    # the internet stand-in, asks an outside resolver, and reaches the host's services.
    gateway = Engine("unused").gateway(None)
    cooperative = probing.Where(network={"network": None}, proxy="", gateway=gateway)
    bypassed = world.probe(cooperative)
    isolated = world.probe()

    [direct] = [r for r in bypassed.results if r.category == "internet"]
    assert direct.verdict is Verdict.LEAK and direct.observed == "connected", bypassed.lines
    assert {"internet", "dns-outside", "host", "control-plane"} <= leaks(bypassed), bypassed.lines
    [walled] = [r for r in isolated.results if r.category == "internet"]
    assert walled.verdict is Verdict.OK, isolated.lines
