"""Scratch exploration (to be replaced)."""

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from agents import services as agent_services
from egress.services import issue_token
from tests.egress.conftest import (
    UPSTREAM,
    VICTIM,
    Net,
    Proxy,
    basic,
    closed_by_peer,
    connect,
    read_head,
    send,
    start_proxy,
)
from tests.factories import OrganisationFactory
from tests.netfixtures import DnsServer, TestCA, Upstream, loopback_alias

pytestmark = [
    pytest.mark.suite("hostile-proxy"),
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Iterator[Net]:
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    with (
        DnsServer() as dns,
        Upstream(UPSTREAM, name="good", tls=ca.issue("good.test", "evil.test")) as tls,
        Upstream(loopback_alias(5), name="plain") as plain,
        Upstream(
            VICTIM, name="victim", tls=ca.issue("good.test", "evil.test"), port=tls.port
        ) as victim,
    ):
        dns.set("good.test", UPSTREAM)
        dns.set("evil.test", VICTIM)
        yield Net(ca, dns, tls, victim, plain)


@dataclass
class Target:
    proxy: Proxy
    process: psutil.Process
    credentials: str
    target: str


@pytest.fixture
def hostile(outside, tmp_path, transactional_db) -> Iterator[Target]:
    org = OrganisationFactory(name="Acme")
    agent = agent_services.create_agent(org, "builder", allowlist=[f"good.test:{outside.tls.port}"])
    _, credentials = issue_token(agent)
    with start_proxy(tmp_path, outside) as proxy:
        proxy.sync()
        me = psutil.Process()
        found = [
            p
            for p in me.children(recursive=True)
            if f"127.0.0.1:{proxy.port}" in " ".join(p.cmdline())
        ]
        assert len(found) == 1
        yield Target(proxy, found[0], credentials, f"good.test:{outside.tls.port}")


def test_explore(hostile, outside):
    p = hostile.proxy
    print("rss", hostile.process.memory_info().rss >> 20)
    for raw in [
        os.urandom(300) + b"\r\n\r\n",
        b"\x00" * 100,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\r\n\r\n",
        b"CONNECT\r\n\r\n",
        b"CONNECT " + b"a" * 100000 + b":443 HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",
        b"CONNECT good.test:1 HTTP/1.1\r\nProxy-Authorization: Basic \xc3\xa9\r\n\r\n",
        b"GET http://good.test/ HTTP/1.1\r\nHost: good.test\r\nProxy-Authorization: Basic \xc3\xa9\r\n\r\n",
    ]:
        t = time.monotonic()
        sock = socket.create_connection(p.address, timeout=5)
        try:
            sock.sendall(raw)
            a = read_head(sock)
            print(
                repr(raw[:40]),
                a[0],
                a[1].get("x-covey-deny-reason"),
                a[2][:80],
                closed_by_peer(sock, 3),
                time.monotonic() - t,
            )
        except Exception as e:
            print(repr(raw[:40]), "EXC", e)
    print(p.output()[-3000:])
    print("rss", hostile.process.memory_info().rss >> 20)
