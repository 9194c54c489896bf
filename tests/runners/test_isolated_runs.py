"""Runs under hard isolation end to end (COVEY_EGRESS_ISOLATION=network on the runner host):
the control plane (gunicorn), a runner process with no database, its proxy container from the
real image (`make egress-image`), real sandboxes on the runner's internal network.

What the proxy container reaches lives on the host's address on Docker's default bridge, which
is what ``host.docker.internal`` means inside it (Docker 20.10's host-gateway): a relay to the
control plane (gunicorn listens on loopback only), a DNS server that names the upstream, and the
upstream itself (port 80: plain HTTP goes only to entries naming port 80). The proxy reaches
them from its outward network; sandboxes must not reach any of them but through the proxy.
"""

import http.server
import io
import ipaddress
import json
import random
import re
import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, closing, suppress
from uuid import uuid4

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from dnslib import QTYPE, RCODE, RR, A  # type: ignore[import-untyped]
from dnslib.server import BaseResolver, DNSLogger, DNSServer  # type: ignore[import-untyped]

from egress.models import EgressToken
from runners import isolation
from runners.engine import Engine
from runners.host import docker_name
from runners.models import Runner
from runners.services import installation_key, renew_runner_tokens
from runs import services as run_services
from runs.models import FINISHED, RunStatus
from tests.processes import wait_for
from tests.runners.test_isolation import egress_image, firewall, leftovers  # noqa: F401
from tests.runners.test_runs import Stack, containers_of, docker

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]

UPSTREAM_NAME = "upstream.isolated-runs.example"
OFF_LIST_NAME = "off-list.isolated-runs.example"
SESSION = uuid4().hex[:8]
OUTSIDE_LABEL = f"covey.test=outside-{SESSION}"

# Runs as root in a stand-in container: TCP listeners on the given ports, and on UDP 53 a
# resolver that answers every A question with 192.0.2.1.
OUTSIDE = r"""
import socket, sys, threading
def tcp(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        s.accept()[0].close()
def dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 53))
    while True:
        query, sender = s.recvfrom(512)
        end = query.index(b"\0", 12) + 5
        answer = b"\xc0\x0c\0\1\0\1\0\0\0\x3c\0\4" + bytes([192, 0, 2, 1])
        s.sendto(query[:2] + b"\x81\x80\0\1\0\1\0\0\0\0" + query[12:end] + answer, sender)
for port in sys.argv[1:]:
    threading.Thread(target=tcp, args=(int(port),), daemon=True).start()
print("ready", flush=True)
dns()
"""


class Outside:
    """What stands for the world outside a sandbox, as containers: "the internet" on Docker's
    default bridge (TCP 443, a resolver on UDP 53) and a private LAN on a network of its own
    (TCP 80 and 8080). Sandboxes must reach none of it directly."""

    def __init__(self, base_image: str) -> None:
        self.containers: list[str] = []
        self.lan_network = f"covey-test-lan-{SESSION}"
        try:
            docker("network", "create", "--label", OUTSIDE_LABEL, self.lan_network)
            self.internet = self._start("internet", "bridge", base_image, 443)
            self.lan = self._start("lan", self.lan_network, base_image, 80, 8080)
        except BaseException:
            self.close()
            raise

    def _start(self, role: str, network: str, image: str, *ports: int) -> str:
        name = f"covey-test-{role}-{SESSION}"
        docker(
            "run", "--detach", "--name", name, "--label", OUTSIDE_LABEL, "--network", network,
            image, "python3", "-c", OUTSIDE, *map(str, ports),
        )  # fmt: skip
        self.containers.append(name)
        wait_for(lambda: "ready" in docker("logs", name), 30, f"the {role} stand-in")
        attrs = json.loads(docker("inspect", name))[0]
        return str(attrs["NetworkSettings"]["Networks"][network]["IPAddress"])

    def targets(self) -> dict[str, str]:
        """The runner host's probe settings: every target is a stand-in on this machine."""
        return {
            "COVEY_EGRESS_PROBE_INTERNET": f"{self.internet}:443",
            "COVEY_EGRESS_PROBE_PRIVATE": f"{self.lan}:8080",
            "COVEY_EGRESS_PROBE_METADATA": f"{self.lan}:80",
            "COVEY_EGRESS_PROBE_RESOLVERS": f"{self.internet}:53",
            "COVEY_EGRESS_PROBE_IPV6": "[fd00:c0de::1]:443",  # unique local: no route anywhere
        }

    def close(self) -> None:
        if self.containers:
            subprocess.run(["docker", "rm", "--force", *self.containers], capture_output=True)
        subprocess.run(["docker", "network", "rm", self.lan_network], capture_output=True)


def host_bridge_address() -> str:
    """The host's address on Docker's default bridge: host.docker.internal in the proxy."""
    return Engine("address").bridge_address()


class OneName(BaseResolver):
    """Answers one name with one IPv4 address; NXDOMAIN for every other name."""

    def __init__(self, name: str, address: str) -> None:
        self.name, self.address = name, address

    def resolve(self, request, handler):
        reply = request.reply()
        question = request.q
        if str(question.qname).rstrip(".").lower() != self.name:
            reply.header.rcode = RCODE.NXDOMAIN
        elif question.qtype == QTYPE.A:
            reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(self.address), ttl=0))
        return reply


class Upstream(http.server.BaseHTTPRequestHandler):
    body = b""
    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Host", ""))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


class Relay(socketserver.ThreadingTCPServer):
    """Forwards every connection to a loopback port (the control plane listens only there)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], target_port: int) -> None:
        self.target_port = target_port
        super().__init__(address, RelayHandler)


class RelayHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        assert isinstance(self.server, Relay)
        try:
            target = socket.create_connection(("127.0.0.1", self.server.target_port))
        except OSError:
            return  # the control plane is down (restarting, or the test is over)
        with closing(target):
            back = threading.Thread(target=_pipe, args=(target, self.request), daemon=True)
            back.start()
            _pipe(self.request, target)
            back.join(30)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with suppress(OSError):  # the other side is gone already
            sink.shutdown(socket.SHUT_WR)


def serve(stack: ExitStack, server: socketserver.BaseServer) -> None:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    stack.callback(server.server_close)
    stack.callback(server.shutdown)


class World:
    """The control plane, what the proxy reaches on the host, and the runner's cleanup."""

    def __init__(self, tmp_path, base_image: str, proxy_image: str, **control_plane_env) -> None:
        self.proxy_image = proxy_image
        self.control_plane_env = control_plane_env
        self.resources = ExitStack()
        self.runner_names: list[str] = []
        try:
            self._start(tmp_path, base_image)
        except BaseException:
            self.resources.close()
            raise

    def _start(self, tmp_path, base_image: str) -> None:
        self.host = host_bridge_address()
        self.body = f"hello from upstream {uuid4().hex}"
        Upstream.body, Upstream.seen = self.body.encode(), []
        try:
            upstream = http.server.ThreadingHTTPServer((self.host, 80), Upstream)
        except OSError as exc:
            pytest.fail(f"cannot listen on {self.host}:80 for the upstream: {exc}")
        serve(self.resources, upstream)
        quiet = DNSLogger(log="-request,-reply,-truncated,-error", logf=lambda _message: None)
        self.names = OneName(UPSTREAM_NAME, self.host)  # tests may point the name elsewhere
        dns = DNSServer(self.names, address=self.host, port=0, logger=quiet)
        self.dns_port = dns.server.server_address[1]
        dns.start_thread()
        self.resources.callback(dns.stop)
        self.outside = Outside(base_image)
        self.resources.callback(self.outside.close)
        self.stack = Stack(
            tmp_path,
            base_image,
            COVEY_EGRESS_ISOLATION="network",
            # The proxy's requests arrive through the relay under this name.
            DJANGO_ALLOWED_HOSTS="127.0.0.1,host.docker.internal",
            # The probe's vendor: the upstream (agents that may reach it are probed as).
            COVEY_EGRESS_PROBE_ALLOWED=f"{UPSTREAM_NAME}:80",
            COVEY_EGRESS_PROBE_OFF_LIST=f"{OFF_LIST_NAME}:443",
            **self.control_plane_env,
        )
        self.resources.callback(self.stack.close)
        relay = Relay((self.host, 0), self.stack.port)
        self.relay_port = relay.server_address[1]
        serve(self.resources, relay)

    def runner_env(self, **changes: str) -> dict[str, str]:
        """The runner host's isolation settings (its proxy gets the last two)."""
        return {
            "COVEY_EGRESS_ISOLATION": "network",
            "COVEY_RUNNER_PROXY_IMAGE": self.proxy_image,
            "COVEY_RUNNER_PROXY_CONTROL_PLANE_URL": (
                f"http://host.docker.internal:{self.relay_port}"
            ),
            "COVEY_EGRESS_NAMESERVERS": f"{self.host}@{self.dns_port}",
            "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": f"{self.host}/32",
            **self.outside.targets(),
            **changes,
        }

    def register(self, organisation, name: str):
        runner, config = self.stack.register(organisation, name)
        self.runner_names.append(docker_name(runner.pk, installation_key()))
        return runner, config

    def close(self) -> None:
        try:
            self.resources.close()  # the runners' sandboxes go with the stack
        finally:
            for name in self.runner_names:
                isolation.teardown(name)
                isolation.remove_rules(name)
        for name in self.runner_names:
            assert leftovers(name) == [], f"runner {name}'s isolation was left behind"


@pytest.fixture
def world(tmp_path, base_image, egress_image) -> Iterator[World]:  # noqa: F811
    # Networks, the proxy and firewall rules are the host's, named after the runner id: start
    # the ids far from where other sessions' test databases (and this one's) hand them out.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)",
            [Runner._meta.db_table, random.randrange(10**6, 10**9)],
        )
    built = World(tmp_path, base_image, egress_image)
    yield built
    built.close()


def test_a_sandbox_reaches_its_upstream_through_the_proxy_and_nothing_directly(world, acme):
    runner, config = world.register(acme, "isolated-1")
    name = docker_name(runner.pk, installation_key())
    with world.stack.runner(runner, config, **world.runner_env()) as process:
        assert f"sandboxes on {isolation.internal_network_name(name)}" in process.output()
        internal = json.loads(docker("network", "inspect", isolation.internal_network_name(name)))
        gateway = internal[0]["IPAM"]["Config"][0]["Gateway"]  # the host, on the sandbox's side
        script = f"""
echo "proxy=$HTTP_PROXY" | sed 's|//.*@|//***@|'
echo "via proxy: $(curl -sS --max-time 10 http://{UPSTREAM_NAME}/)"
curl -sS --max-time 10 -o /dev/null -D - http://{OFF_LIST_NAME}/ | tr -d '\\r' | grep -i -e '^HTTP/' -e '^x-covey-deny-reason'
curl -sS --noproxy '*' --connect-timeout 3 http://{world.host}/; echo "direct upstream: exit $?"
curl -sS --noproxy '*' --connect-timeout 3 http://{gateway}:{world.relay_port}/; echo "direct host: exit $?"
"""  # noqa: E501
        agent = world.stack.agent(
            acme, "Isolated", ["sh", "-c", script], allowlist=[f"{UPSTREAM_NAME}:80"]
        )
        run = world.stack.wait(run_services.queue_run(agent, "fetch"), *FINISHED, timeout=60)
        assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
        log = run.log_tail
        proxy_ip = str(ipaddress.ip_network(internal[0]["IPAM"]["Config"][0]["Subnet"])[2])

        # A rule removed behind the runner's back: the next launch's preflight repairs it.
        isolation.remove_rules(name)
        again = world.stack.wait(run_services.queue_run(agent, "again"), *FINISHED, timeout=60)
        assert again.status == RunStatus.SUCCEEDED, (again.status_detail, again.log_tail)
        assert re.search(r"isolation preflight: .*missing .*; repairing", process.output())

        # Several at once, each asking through the proxy at its first instant: every run's
        # credential works from the first byte (the proxy looks up a token it has not seen).
        eager = world.stack.agent(
            acme,
            "Eager",
            [
                "sh",
                "-c",
                f"curl -sS --max-time 10 -w ' status=%{{http_code}}' http://{UPSTREAM_NAME}/",
            ],
            allowlist=[f"{UPSTREAM_NAME}:80"],
        )
        burst = [run_services.queue_run(eager, f"burst {i}") for i in range(5)]
        for one in burst:
            world.stack.wait(one, *FINISHED, timeout=90)
        assert [(r.status, r.log_tail.split()[-1]) for r in burst] == [
            (RunStatus.SUCCEEDED, "status=200")
        ] * 5, [r.log_tail for r in burst]

    # (a) Through the proxy, which the sandbox is told of although COVEY_EGRESS_ENFORCE is off.
    assert f"proxy=http://***@{proxy_ip}:3128\n" in log, log
    assert f"via proxy: {world.body}" in log
    assert Upstream.seen.count(UPSTREAM_NAME) == 2 + 5  # both runs and the burst
    # (c) A name off the allowlist: the proxy refuses it.
    assert re.search(r"^HTTP/1\.1 403", log, re.M), log
    assert re.search(r"^x-covey-deny-reason: not-on-allowlist$", log, re.M | re.I), log
    # (b) Nothing directly: the upstream's address and the host time out (dropped; a
    # connection refused would mean the packets got there).
    assert "direct upstream: exit 28" in log, log
    assert "direct host: exit 28" in log, log
    assert f"via proxy: {world.body}" in again.log_tail
    assert not containers_of(runner)


def test_a_runner_whose_isolation_cannot_be_built_gets_no_work(world, acme):
    runner, config = world.register(acme, "isolated-2")
    missing = f"covey-egress-missing-{uuid4().hex[:8]}:none"
    agent = world.stack.agent(acme, "Refused", ["echo", "must not run"])
    env = world.runner_env(COVEY_RUNNER_PROXY_IMAGE=missing)
    with world.stack.runner(runner, config, **env) as process:
        run = run_services.queue_run(agent, "nope")

        def held() -> bool:
            run.refresh_from_db()
            return "isolated-2 failed its egress probe" in run.status_detail

        wait_for(held, 30, "the run held back for the failed probe")
        assert not containers_of(runner)  # no sandbox was ever created
        output = process.output()
    runner.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert f"image {missing} is not on this host" in run.status_detail
    assert (runner.isolation, runner.trusted) == ("network", False)
    assert runner.last_probe.status == "error"
    # The runner kept running: it said so at start, once, and took no work.
    assert "no isolation yet; launches are refused" in output
    assert "egress probe FAILED: no work until one passes" in output
    assert output.count(f"isolation: image {missing} is not on this host") == 1, output
    run_services.cancel(run)


def test_a_launch_the_preflight_cannot_vouch_for_is_refused(world, acme):
    runner, config = world.register(acme, "isolated-4")
    name = docker_name(runner.pk, installation_key())
    proxy = isolation.proxy_container_name(name)
    agent = world.stack.agent(acme, "Refused", ["echo", "must not run"])
    with world.stack.runner(runner, config, **world.runner_env()):
        runner.refresh_from_db()
        assert runner.trusted, runner.last_probe and runner.last_probe.summary

        # Something else takes the proxy's name: the runner may not remove it, so the launch's
        # repair fails and the preflight cannot vouch for the shape.
        def taken() -> bool:
            # The runner's reconcile may put its proxy back between the two: try again.
            subprocess.run(["docker", "rm", "--force", proxy], capture_output=True)
            impostor = ["docker", "create", "--name", proxy, "--label", OUTSIDE_LABEL]
            created = subprocess.run(
                [*impostor, world.stack.base_image, "true"], capture_output=True
            )
            return created.returncode == 0

        wait_for(taken, 30, "another container under the proxy's name")
        try:
            run = world.stack.wait(run_services.queue_run(agent, "nope"), *FINISHED, timeout=60)
            assert not containers_of(runner)
        finally:
            docker("rm", "--force", proxy)
    assert run.status == RunStatus.FAILED
    assert run.status_detail.startswith(
        "the sandbox could not be built: isolation preflight failed: "
    ), run.status_detail
    assert f"a container named {proxy} exists and covey did not make it" in run.status_detail
    assert "must not run" not in run.log_tail


def test_egress_probe_proves_the_runner_and_a_failed_probe_stops_its_work(world, acme, alice):
    runner, config = world.register(acme, "isolated-5")
    agent = world.stack.agent(
        acme,
        "Fetcher",
        ["sh", "-c", f"curl -sS --max-time 10 http://{UPSTREAM_NAME}/"],
        allowlist=[f"{UPSTREAM_NAME}:80"],
    )
    bridge = isolation.bridge_name(docker_name(runner.pk, installation_key()))
    hole = ["INPUT", "-i", bridge, "-m", "comment", "--comment", OUTSIDE_LABEL, "-j", "ACCEPT"]
    with world.stack.runner(runner, config, **world.runner_env()) as process:
        # At start: probed as the agent that may reach the vendor, and trusted.
        runner.refresh_from_db()
        assert runner.last_probe.status == "passed", runner.last_probe.checks
        assert runner.last_probe.agent == agent
        assert "egress probe passed" in process.output()

        out = io.StringIO()
        call_command("egress_probe", "--runner", str(runner.pk), stdout=out)
        printed = out.getvalue()
        assert f"egress probe of runner isolated-5 ({acme}), network isolation" in printed
        assert re.search(r"^  ok +allowed +via proxy ", printed, re.M), printed
        assert re.search(r"^  ok +host +tcp ", printed, re.M), printed
        assert "passed: " in printed

        # A hole ahead of covey's rules: the preflight before the probe puts them back first.
        subprocess.run(["iptables", "-w", "10", "-I", *hole[:1], "1", *hole[1:]], check=True)
        try:
            call_command("egress_probe", "--runner", str(runner.pk), stdout=io.StringIO())
            chain = subprocess.run(
                ["iptables", "-w", "10", "-S", "INPUT"], capture_output=True, text=True
            ).stdout
            assert chain.index(f"covey:{docker_name(runner.pk, installation_key())}") < chain.index(
                OUTSIDE_LABEL
            ), chain
            assert "comes before covey's rules; repairing" in process.output()
        finally:
            subprocess.run(["iptables", "-w", "10", "-D", *hole], check=True)

        # The vendor out of reach (its name now resolves to loopback, which the proxy refuses):
        # the probe fails, and the runner gets no work until one passes.
        world.names.address = "127.0.0.1"
        try:
            out = io.StringIO()
            with pytest.raises(CommandError) as failed:
                call_command("egress_probe", "--runner", f"{acme.slug}/isolated-5", stdout=out)
            assert failed.value.returncode == 1
            assert re.search(
                r"^  FAIL +allowed +via proxy .* 403 non-public-address$", out.getvalue(), re.M
            ), out.getvalue()
            run = run_services.queue_run(agent, "after the failure")
            run.refresh_from_db()
            assert run.status == RunStatus.QUEUED
            assert "isolated-5 failed its egress probe" in run.status_detail
            assert "1 failed; first: allowed" in run.status_detail
        finally:
            world.names.address = world.host

        # Closed again: the next probe passes and the waiting run goes.
        call_command("egress_probe", "--runner", str(runner.pk), stdout=io.StringIO())
        run = world.stack.wait(run, *FINISHED, timeout=60)
        with world.stack.api(alice) as api:
            body = api.get(f"/api/v1/runners/{runner.pk}/").json()
            probes = api.get(f"/api/v1/runners/{runner.pk}/probes/").json()
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    assert (body["isolation"], body["trusted"], body["last_probe"]["status"]) == (
        "network",
        True,
        "passed",
    )
    statuses = [p["status"] for p in probes["results"]]
    assert statuses == ["passed", "failed", "passed", "passed", "passed"], statuses
    assert any(line.startswith("FAIL") for line in probes["results"][1]["lines"])
    # The probes' credentials ended with them.
    assert not EgressToken.objects.filter(purpose__startswith="egress probe").live().exists()


def test_a_renewed_token_reaches_the_proxy_container(world, acme, settings):
    settings.COVEY_BUILTIN_RUNNER = False  # no built-in identity files from this process
    runner, config = world.register(acme, "isolated-3")
    proxy = isolation.proxy_container_name(docker_name(runner.pk, installation_key()))
    agent = world.stack.agent(
        acme,
        "Fetcher",
        ["sh", "-c", f"curl -sS --max-time 10 http://{UPSTREAM_NAME}/"],
        allowlist=[f"{UPSTREAM_NAME}:80"],
    )
    with world.stack.runner(runner, config, **world.runner_env()):
        before = json.loads(docker("inspect", proxy))[0]["Id"]
        world.stack.stop_control_plane()
        renew_runner_tokens()
        world.stack.start_control_plane()

        def renewed() -> bool:
            try:  # between its removal and its successor, there is no proxy to inspect
                environment = json.loads(docker("inspect", proxy))[0]["Config"]["Env"]
            except subprocess.CalledProcessError:
                return False
            return f"COVEY_RUNNER_TOKEN={json.loads(config.read_text())['token']}" in environment

        wait_for(renewed, 30, "the proxy recreated with the renewed token")
        run = world.stack.wait(run_services.queue_run(agent, "after"), *FINISHED, timeout=60)
    assert json.loads(docker("inspect", proxy))[0]["Id"] != before
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    assert run.log_tail == world.body
