"""The loopback network fixtures work: real DNS over UDP and TCP, TLS upstreams, clean stops."""

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.resolver
import httpx
import pytest

from tests import workers
from tests.netfixtures import DnsServer, TestCA, Upstream, loopback_alias


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test must leave exactly as many threads running as it found."""
    before = threading.active_count()
    yield
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path)


def resolver_for(server: DnsServer) -> dns.resolver.Resolver:
    """A dnspython resolver that asks only this server, with no cache and short timeouts."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [server.address]
    resolver.port = server.port
    resolver.timeout = resolver.lifetime = 2.0
    return resolver


def addresses(answer: dns.resolver.Answer) -> list[str]:
    return sorted(record.address for record in answer)


# -- DNS --------------------------------------------------------------------------------------


def test_dns_answers_a_and_aaaa_by_query_type_with_ttl_zero() -> None:
    with DnsServer() as server:
        server.set("api.test", "10.1.2.3", "2001:db8::1", "10.1.2.4")
        resolver = resolver_for(server)

        a = resolver.resolve("api.test", "A")
        aaaa = resolver.resolve("api.test", "AAAA")

        assert addresses(a) == ["10.1.2.3", "10.1.2.4"]
        assert addresses(aaaa) == ["2001:db8::1"]
        assert a.rrset is not None and a.rrset.ttl == 0
        assert aaaa.rrset is not None and aaaa.rrset.ttl == 0
        assert server.queries("api.test") == 2


def test_dns_address_and_nameserver_spelling() -> None:
    with DnsServer() as server:
        assert server.address == "127.0.0.1"
        assert isinstance(server.port, int) and server.port > 0
        assert server.nameserver == f"127.0.0.1@{server.port}"


def test_dns_unknown_name_is_nxdomain_and_still_counted() -> None:
    with DnsServer() as server:
        server.set("known.test", "10.0.0.1")
        with pytest.raises(dns.resolver.NXDOMAIN):
            resolver_for(server).resolve("unknown.test", "A")
        assert server.queries("unknown.test") == 1


def test_dns_known_name_without_that_family_is_an_empty_noerror() -> None:
    with DnsServer() as server:
        server.set("v4only.test", "10.0.0.1")
        response = dns.query.udp(
            dns.message.make_query("v4only.test", "AAAA"), server.address, 2, port=server.port
        )
        assert response.rcode() == dns.rcode.NOERROR
        assert response.answer == []


def test_dns_names_ignore_case_and_trailing_dot() -> None:
    with DnsServer() as server:
        server.set("Mixed.Case.TEST.", "10.9.9.9")
        resolver = resolver_for(server)

        for spelling in ("mixed.case.test", "MIXED.CASE.TEST.", "mIxEd.cAsE.tEsT"):
            assert addresses(resolver.resolve(spelling, "A")) == ["10.9.9.9"]
        assert server.queries("mixed.case.test.") == 3


def test_dns_remove_and_replace() -> None:
    with DnsServer() as server:
        resolver = resolver_for(server)
        server.set("moving.test", "10.0.0.1")
        server.set("MOVING.test", "10.0.0.2")
        assert addresses(resolver.resolve("moving.test", "A")) == ["10.0.0.2"]

        server.remove("moving.test.")
        with pytest.raises(dns.resolver.NXDOMAIN):
            resolver.resolve("moving.test", "A")


def test_dns_sequence_changes_answers_between_a_queries_and_repeats_the_last() -> None:
    with DnsServer() as server:
        server.sequence("rebind.test", [["93.184.216.34"], ["127.0.0.1"], ["10.0.0.7"]])
        resolver = resolver_for(server)

        seen = [addresses(resolver.resolve("rebind.test", "A")) for _ in range(5)]

        assert seen == [
            ["93.184.216.34"],
            ["127.0.0.1"],
            ["10.0.0.7"],
            ["10.0.0.7"],
            ["10.0.0.7"],
        ]
        assert server.queries("rebind.test") == 5


def test_dns_sequence_aaaa_follows_the_a_list_in_resolve_name() -> None:
    with DnsServer() as server:
        server.sequence("both.test", [["192.0.2.1", "2001:db8::1"], ["127.0.0.1", "::1"]])
        resolver = resolver_for(server)

        first = sorted(resolver.resolve_name("both.test").addresses())
        second = sorted(resolver.resolve_name("both.test").addresses())

        assert first == ["192.0.2.1", "2001:db8::1"]
        assert second == ["127.0.0.1", "::1"]


def test_dns_answers_over_tcp_on_the_same_port() -> None:
    with DnsServer() as server:
        server.set("tcp.test", "10.4.4.4", "2001:db8::4")

        answer = resolver_for(server).resolve("tcp.test", "A", tcp=True)
        response = dns.query.tcp(
            dns.message.make_query("tcp.test", "AAAA"), server.address, 2, port=server.port
        )
        missing = dns.query.tcp(
            dns.message.make_query("nope.test", "A"), server.address, 2, port=server.port
        )

        assert addresses(answer) == ["10.4.4.4"]
        assert [rr.address for rrset in response.answer for rr in rrset] == ["2001:db8::4"]
        assert missing.rcode() == dns.rcode.NXDOMAIN


def test_dns_stop_is_prompt_with_an_idle_tcp_client_and_idempotent() -> None:
    server = DnsServer().start()
    idle = socket.create_connection((server.address, server.port))
    try:
        time.sleep(0.1)  # let the server hand the connection to a worker thread
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 2
        server.stop()
    finally:
        idle.close()


def test_dns_refuses_to_bind_outside_loopback() -> None:
    with pytest.raises(ValueError):
        DnsServer("0.0.0.0")


# -- HTTP upstreams ---------------------------------------------------------------------------


def test_loopback_alias() -> None:
    assert loopback_alias(2) == f"127.0.{workers.loopback_block()}.2"
    with pytest.raises(ValueError):
        loopback_alias(0)


def test_plain_upstream_answers_hello_and_records_host() -> None:
    with Upstream(name="alpha") as upstream, httpx.Client() as client:
        response = client.get(upstream.url("/"), headers={"Host": "alpha.test"})

        assert response.status_code == 200
        assert response.content == b"hello from alpha"
        assert response.headers["content-length"] == str(len(b"hello from alpha"))
        assert upstream.url("/x") == f"http://127.0.0.1:{upstream.port}/x"
        request = upstream.last_request
        assert request is not None
        assert (request.method, request.path, request.host) == ("GET", "/", "alpha.test")
        assert request.header("HOST") == "alpha.test"
        assert request.sni is None
        assert upstream.snis == []


def test_echo_returns_request_line_headers_and_host() -> None:
    with Upstream() as upstream, httpx.Client() as client:
        response = client.get(
            upstream.url("/echo?q=1"), headers={"Host": "echo.test", "X-Probe": "yes"}
        )

        echo = response.json()
        assert response.headers["content-type"] == "application/json"
        assert echo["request_line"] == "GET /echo?q=1 HTTP/1.1"
        assert echo["host"] == "echo.test"
        assert ["X-Probe", "yes"] in echo["headers"]
        assert upstream.requests[0].path == "/echo?q=1"


def test_bytes_returns_exactly_that_many_bytes() -> None:
    with Upstream() as upstream, httpx.Client() as client:
        received = 0
        with client.stream("GET", upstream.url("/bytes/1000000")) as response:
            assert response.headers["content-length"] == "1000000"
            for chunk in response.iter_raw():
                received += len(chunk)
        assert received == 1_000_000
        assert client.get(upstream.url("/bytes/0")).content == b""


def test_tls_upstream_on_an_alias_verifies_with_the_ca_and_records_sni(ca: TestCA) -> None:
    assert ca.ca_file.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    tls = ca.issue("api.test")
    with (
        Upstream(loopback_alias(2), name="api", tls=tls) as upstream,
        httpx.Client(verify=ca.client_context()) as client,
    ):
        assert upstream.url("/") == f"https://{loopback_alias(2)}:{upstream.port}/"
        response = client.get(
            upstream.url("/"),
            headers={"Host": "api.test"},
            extensions={"sni_hostname": "api.test"},
        )

        assert response.content == b"hello from api"
        assert upstream.sni == "api.test"
        request = upstream.last_request
        assert request is not None
        assert (request.host, request.sni) == ("api.test", "api.test")
        assert request.client[0] == "127.0.0.1"

        with (  # verification is really on (a fresh client: no pooled connection to reuse)
            httpx.Client(verify=ca.client_context()) as fresh,
            pytest.raises(httpx.ConnectError),
        ):
            fresh.get(upstream.url("/"), extensions={"sni_hostname": "other.test"})
        assert upstream.snis == ["api.test", "other.test"]


def test_tls_upstream_with_the_ca_file_and_a_dns_name(ca: TestCA) -> None:
    """The CA file on disk verifies too, and a DnsServer can point a name at an upstream."""
    with (
        DnsServer() as server,
        Upstream(loopback_alias(3), tls=ca.issue("svc.test")) as upstream,
        httpx.Client(verify=ssl.create_default_context(cafile=ca.ca_file)) as client,
    ):
        server.set("svc.test", upstream.host)
        (address,) = addresses(resolver_for(server).resolve("svc.test", "A"))
        response = client.get(
            f"https://{address}:{upstream.port}/echo",
            headers={"Host": "svc.test"},
            extensions={"sni_hostname": "svc.test"},
        )
        assert json.loads(response.content)["sni"] == "svc.test"


def test_upstream_stop_closes_idle_keepalive_and_stalled_tls_connections(ca: TestCA) -> None:
    upstream = Upstream(tls=ca.issue("idle.test")).start()
    client = httpx.Client(verify=ca.client_context())
    stalled = socket.create_connection((upstream.host, upstream.port))  # never says hello
    try:
        response = client.get(upstream.url("/"), extensions={"sni_hostname": "idle.test"})
        assert response.status_code == 200
        time.sleep(0.1)  # both connections now sit in worker threads
        started = time.monotonic()
        upstream.stop()
        assert time.monotonic() - started < 2
        assert upstream.connections == 2
        assert upstream.spoken == 1  # the stalled one never sent a byte
        assert upstream.snis == ["idle.test"]
        assert upstream.errors == []
        upstream.stop()
    finally:
        stalled.close()
        client.close()


def test_a_connection_closed_without_a_byte_is_counted_but_not_as_spoken() -> None:
    with Upstream() as upstream:
        socket.create_connection((upstream.host, upstream.port)).close()
        with socket.create_connection((upstream.host, upstream.port)) as spoke:
            spoke.sendall(b"x")
        wait_until = time.monotonic() + 5
        while (upstream.connections < 2 or upstream.spoken < 1) and time.monotonic() < wait_until:
            time.sleep(0.01)
        assert (upstream.connections, upstream.spoken) == (2, 1)


def test_tls_client_without_sni_is_recorded_as_none(ca: TestCA) -> None:
    with Upstream(tls=ca.issue("127.0.0.1")) as upstream:  # trustme puts IPs in the SAN
        with httpx.Client(verify=ca.client_context()) as client:  # an IP URL sends no SNI
            assert client.get(upstream.url("/")).status_code == 200
        assert upstream.snis == [None]
        assert upstream.sni is None


def test_upstream_refuses_to_bind_outside_loopback() -> None:
    with pytest.raises(ValueError):
        Upstream("192.0.2.1")
