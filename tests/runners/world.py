"""The world the hard-isolation run tests run in: the control plane (gunicorn, through a relay),
and what the runner's proxy container reaches outside.

What the proxy container reaches lives on the host's address on Docker's default bridge, which
is what ``host.docker.internal`` means inside it (Docker 20.10's host-gateway): a relay to the
control plane (gunicorn listens on loopback only), a DNS server that names the upstream, and the
upstream itself (port 80: plain HTTP goes only to entries naming port 80), which has an
address of its own, the gateway of a network made for it, so that Worlds in test processes
side by side do not meet. The proxy reaches them from its outward network; sandboxes must not
reach any of them but through the proxy.
"""

import http.server
import json
import random
import socket
import socketserver
import subprocess
import threading
import time
from contextlib import ExitStack, closing, suppress
from uuid import uuid4

import pytest
from django.db import connection
from dnslib import QTYPE, RCODE, RR, A  # type: ignore[import-untyped]
from dnslib.server import BaseResolver, DNSLogger, DNSServer  # type: ignore[import-untyped]

from runners.host.containers import isolation
from runners.host.containers.engine import Engine
from runners.host.identity import docker_name
from runners.models import Runner
from runners.services import installation_key
from tests.processes import wait_for
from tests.runners.isolation_support import leftovers
from tests.runners.stack import Stack, docker

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


def runner_ids_apart() -> None:
    """Networks, the proxy and firewall rules are the host's, named after the runner id: start
    the ids far from where other sessions' test databases (and this one's) hand them out."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)",
            [Runner._meta.db_table, random.randrange(10**6, 10**9)],
        )


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


SLOW_CHUNK, SLOW_CHUNKS = b"x" * (100 << 10), 160


class Upstream(http.server.BaseHTTPRequestHandler):
    body = b""
    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Host", ""))
        if self.path == "/slow":  # 16 MB over some 16 s: a transfer to cut in the middle
            self.seen.append("/slow")
            self.send_response(200)
            self.send_header("Content-Length", str(SLOW_CHUNKS * len(SLOW_CHUNK)))
            self.end_headers()
            for _ in range(SLOW_CHUNKS):
                try:
                    self.wfile.write(SLOW_CHUNK)
                except OSError:
                    return  # the other end went (the proxy, killed)
                time.sleep(0.1)
            return
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


def upstream_address(resources: ExitStack) -> str:
    """An address of this host for a World's upstream alone: the gateway of a Docker network
    made for it (gone with ``resources``). The upstream listens on port 80 (plain HTTP goes
    only to entries naming port 80), so each World, in each test process, needs its own
    address; the proxy container reaches the host's addresses as it reaches the relay."""
    network = f"covey-test-upstream-{uuid4().hex[:12]}"
    docker("network", "create", "--label", OUTSIDE_LABEL, network)
    resources.callback(subprocess.run, ["docker", "network", "rm", network], capture_output=True)
    attrs = json.loads(docker("network", "inspect", network))[0]
    return str(attrs["IPAM"]["Config"][0]["Gateway"])


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
        self.upstream_host = upstream_address(self.resources)
        try:
            upstream = http.server.ThreadingHTTPServer((self.upstream_host, 80), Upstream)
        except OSError as exc:
            pytest.fail(f"cannot listen on {self.upstream_host}:80 for the upstream: {exc}")
        serve(self.resources, upstream)
        quiet = DNSLogger(log="-request,-reply,-truncated,-error", logf=lambda _message: None)
        # Tests may point the name elsewhere, and back at upstream_host.
        self.names = OneName(UPSTREAM_NAME, self.upstream_host)
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

    @property
    def direct(self) -> str:
        """The upstream's URL by its address: what a sandbox must not reach but through the
        proxy."""
        return f"http://{self.upstream_host}/"

    def runner_env(self, **changes: str) -> dict[str, str]:
        """The runner host's isolation settings (its proxy gets the last two)."""
        return {
            "COVEY_EGRESS_ISOLATION": "network",
            "COVEY_RUNNER_PROXY_IMAGE": self.proxy_image,
            "COVEY_RUNNER_PROXY_CONTROL_PLANE_URL": (
                f"http://host.docker.internal:{self.relay_port}"
            ),
            "COVEY_EGRESS_NAMESERVERS": f"{self.host}@{self.dns_port}",
            "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": f"{self.host}/32,{self.upstream_host}/32",
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
