"""The real egress proxy as a subprocess, with a test CA, a test DNS server and upstreams.

Nothing here leaves the machine: the upstreams listen on 127.0.0.x, the DNS server answers
only the names the tests give it, and the proxy is told to resolve through it.
"""

import base64
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

from agents import services as agent_services
from egress.services import issue_token, policy_fingerprint
from tests.factories import OrganisationFactory
from tests.netfixtures import DnsServer, TestCA, Upstream, loopback_alias
from tests.processes import free_port, running, wait_for

UPSTREAM = loopback_alias(2)  # "the internet": allowed by COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS
VICTIM = loopback_alias(3)  # a host-local service the proxy must never reach
PLAIN = loopback_alias(5)  # a plain-HTTP upstream on port 80
ALLOWED_PRIVATE = f"{UPSTREAM}/32,{PLAIN}/32"


@dataclass
class Net:
    """The outside world as the tests make it."""

    ca: TestCA
    dns: DnsServer
    tls: Upstream  # HTTPS on UPSTREAM, certificate for every test name
    victim: Upstream  # HTTPS on VICTIM, same port as tls
    plain: Upstream  # HTTP on PLAIN:80


NAMES = ["good.test", "rebind.test", "evil.test", "other.test", "mixed.test", "xn--bcher-kva.test"]


@pytest.fixture(scope="session")
def net(tmp_path_factory) -> Iterator[Net]:
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    with (
        DnsServer() as dns,
        Upstream(UPSTREAM, name="good", tls=ca.issue(*NAMES)) as tls,
        Upstream(PLAIN, name="plain", port=80) as plain,
        # The victim listens on the upstream's port, on an address the proxy must never dial.
        Upstream(VICTIM, name="victim", tls=ca.issue(*NAMES), port=tls.port) as victim,
    ):
        for name in NAMES:
            dns.set(name, UPSTREAM)
        dns.set("plain.test", PLAIN)
        dns.set("private.test", "10.1.2.3")
        dns.set("loopback.test", "127.0.0.1")
        dns.set("metadata.test", "169.254.169.254")
        dns.set("cgnat.test", "100.64.0.7")
        dns.set("mixed.test", UPSTREAM, "10.0.0.1")
        dns.set("mapped.test", "::ffff:127.0.0.1")
        dns.set("nat64.test", "64:ff9b::a9fe:a9fe")
        dns.set("victim.test", VICTIM)
        dns.set("empty.test")  # exists, no addresses
        yield Net(ca, dns, tls, victim, plain)


def subprocess_database_url() -> str:
    """The URL of the database pytest-django made, for processes the tests start."""
    s = connection.settings_dict
    return f"postgres://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


class Proxy:
    """A running ``manage.py egress_proxy``."""

    def __init__(self, port: int, log: Path, process: subprocess.Popen | None = None) -> None:
        self.port = port
        self.log = log
        self.process = process

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def url(self, credentials: str | None = None) -> str:
        return f"http://{credentials + '@' if credentials else ''}127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def sync(self, timeout: float = 5.0) -> float:
        """Wait until the proxy has loaded the database's current policy; returns seconds."""
        started = time.monotonic()
        generation = policy_fingerprint()
        needle = f"egress policy {generation} loaded"
        wait_for(lambda: needle in self.output(), timeout, f"the proxy loading {generation}")
        return time.monotonic() - started


@contextmanager
def start_proxy(tmp_path: Path, net: Net, **env_overrides: str) -> Iterator[Proxy]:
    """Run the proxy command against the test database until the block ends."""
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": subprocess_database_url(),
        "COVEY_EGRESS_NAMESERVERS": net.dns.nameserver,
        "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": ALLOWED_PRIVATE,
        "COVEY_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
        **env_overrides,
    }
    args = [sys.executable, "manage.py", "egress_proxy", "--listen", f"127.0.0.1:{port}"]
    args += env.pop("EXTRA_ARGS", "").split()
    if files := env.pop("OPEN_FILES", ""):  # its ulimit -n (soft and hard)
        args = ["prlimit", f"--nofile={files}:{files}", "--", *args]
    log = tmp_path / f"proxy-{port}.log"
    with running(args, env, log) as process:
        proxy = Proxy(port, log, process)

        def listening() -> bool:
            assert process.poll() is None, proxy.output()
            return "covey egress proxy listening" in proxy.output()

        wait_for(listening, 30, "the proxy listening", log)
        yield proxy
    # Python 3.12.1's asyncio prints cancelled client tasks at shutdown; our code must not fail.
    assert not re.search(r'File ".*/(agents|covey|egress|runners)/', proxy.output()), proxy.output()


@pytest.fixture(scope="session")
def proxy(net, tmp_path_factory, django_db_setup, django_db_blocker):
    with start_proxy(tmp_path_factory.mktemp("proxy"), net) as proxy:
        yield proxy


@pytest.fixture
def world(net, proxy):
    """Acme's builder agent may reach good.test (TLS, its port), plain.test:80 and a few more."""
    net.tls.reset()
    net.victim.reset()
    net.plain.reset()
    org = OrganisationFactory(name="Acme")
    port = net.tls.port
    agent = agent_services.create_agent(
        org,
        "builder",
        allowlist=[
            f"good.test:{port}",
            f"rebind.test:{port}",
            f"mixed.test:{port}",
            f"private.test:{port}",
            f"loopback.test:{port}",
            f"metadata.test:{port}",
            f"cgnat.test:{port}",
            f"mapped.test:{port}",
            f"nat64.test:{port}",
            f"victim.test:{port}",
            f"empty.test:{port}",
            f"nowhere.test:{port}",
            f"xn--bcher-kva.test:{port}",
            "plain.test:80",
        ],
    )
    _, credentials = issue_token(agent)
    proxy.sync()
    return agent, credentials


def basic(credentials: str) -> str:
    return "Basic " + base64.b64encode(credentials.encode()).decode()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    sock: socket.socket


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    match = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
    if not match:
        return 0, {}, data
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(match.group(1)), headers, rest


def send(proxy: Proxy, raw: bytes, sock: socket.socket | None = None) -> Answer:
    """Send raw bytes to the proxy and read one HTTP answer."""
    sock = sock or socket.create_connection(proxy.address, timeout=10)
    sock.sendall(raw)
    status, headers, body = read_head(sock)
    return Answer(status, headers, body, sock)


def connect(proxy: Proxy, target: str, credentials: str | None) -> Answer:
    """CONNECT target through the proxy; the socket stays open for the tunnel."""
    auth = f"Proxy-Authorization: {basic(credentials)}\r\n" if credentials else ""
    return send(proxy, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode())


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True when the other side closes (or resets) the connection within the time."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True
