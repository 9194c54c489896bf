"""The real proxy command, real clients, upstreams and DNS made by the tests (the steps of
docs/architecture.md, "Egress decisions")."""

import base64
import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import threading
import time
from datetime import timedelta

import httpx
import pytest

from agents import services as agent_services
from egress.models import Decision, ProxySession
from egress.services import issue_token, revoke_tokens
from organisations import services as organisation_services
from tests.egress.conftest import (
    UPSTREAM,
    VICTIM,
    basic,
    closed_by_peer,
    connect,
    read_head,
    send,
    start_proxy,
)
from tests.processes import free_port, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def client(proxy, net, credentials):
    return httpx.Client(proxy=proxy.url(credentials), verify=net.ca.client_context(), timeout=10)


def test_an_allowed_tunnel_reaches_the_upstream_end_to_end(proxy, net, world):
    agent, credentials = world
    with client(proxy, net, credentials) as http:
        response = http.get(f"https://good.test:{net.tls.port}/")
    assert response.status_code == 200
    assert response.text == "hello from good"
    assert net.tls.sni == "good.test"
    # The proxy never decrypts: the upstream saw no proxy credentials.
    assert net.tls.last_request.header("Proxy-Authorization") is None

    def logged():
        row = Decision.objects.filter(agent=agent, allowed=True, closed_at__isnull=False).first()
        return row is not None and row.bytes_down > 0

    wait_for(logged, 10, "the tunnel in the decision log")
    row = Decision.objects.get(agent=agent, allowed=True)
    assert (row.host, row.port, row.address, row.kind) == (
        "good.test",
        net.tls.port,
        UPSTREAM,
        "connect",
    )
    assert row.reason == "allowed"
    assert row.detail == "agent"
    assert row.bytes_up > 0


def test_curl_works_through_it(proxy, net, world):
    _, credentials = world
    proxy_args = ["--proxy", proxy.url(), "--proxy-user", credentials]
    tls_args = ["--cacert", str(net.ca.ca_file)]
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "10",
            *proxy_args,
            *tls_args,
            f"https://good.test:{net.tls.port}/",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from good"


class TestIdentity:
    @pytest.mark.parametrize(
        "credentials",
        [None, "acme.builder:wrong", "acme.other:{secret}", "nobody:x", "acme.builder:"],
    )
    def test_missing_or_bad_credentials_get_407(self, proxy, net, world, credentials):
        secret = world[1].split(":", 1)[1]
        if credentials:
            credentials = credentials.format(secret=secret)
        answer = connect(proxy, f"good.test:{net.tls.port}", credentials)
        assert answer.status == 407
        assert answer.headers["x-covey-deny-reason"] == "proxy-auth-required"
        assert answer.headers["proxy-authenticate"].startswith("Basic")

    def test_a_malformed_header_gets_407(self, proxy, net, world):
        target = f"good.test:{net.tls.port}"
        raw = (
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic !!\r\n\r\n"
        )
        assert send(proxy, raw.encode()).status == 407

    def test_an_expired_token_stops_working_on_the_live_proxy(self, proxy, net, world):
        agent, _ = world
        _, credentials = issue_token(agent, ttl=timedelta(seconds=2))
        proxy.sync()
        target = f"good.test:{net.tls.port}"
        assert connect(proxy, target, credentials).status == 200
        time.sleep(2.1)
        assert connect(proxy, target, credentials).status == 407

    def test_a_revoked_token_is_refused_within_a_second(self, proxy, net, world):
        agent, credentials = world
        target = f"good.test:{net.tls.port}"
        assert connect(proxy, target, credentials).status == 200
        revoke_tokens(agent.tokens.all())
        started = time.monotonic()
        wait_for(lambda: connect(proxy, target, credentials).status == 407, 1.0, "refusal")
        assert time.monotonic() - started < 1.0

    def test_every_request_on_a_connection_is_authorised(self, proxy, net, world):
        _, credentials = world
        auth = f"Proxy-Authorization: {basic(credentials)}\r\n"
        good = f"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n{auth}\r\n"
        first = send(proxy, good.encode())
        assert first.status == 200, first.body
        bad = "GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n\r\n"
        second = send(proxy, bad.encode(), sock=first.sock)
        assert second.status == 407


class TestDenyCodes:
    @pytest.mark.parametrize(
        ("target", "code"),
        [
            ("other.test:443", "not-on-allowlist"),
            ("evil.test:{port}", "not-on-allowlist"),
            ("goodxtest:{port}", "not-on-allowlist"),
            ("good.test.evil.test:{port}", "not-on-allowlist"),
            ("evilgood.test:{port}", "not-on-allowlist"),
            ("xn--gd-ema.test:{port}", "not-on-allowlist"),  # a look-alike of good.test
            ("good.test:22", "port-not-allowed"),
            ("good.test:443", "port-not-allowed"),
            ("127.0.0.1:{port}", "ip-literal"),
            ("127.0.0.2:{port}", "ip-literal"),
            ("2130706434:{port}", "ip-literal"),
            ("0x7f.0.0.2:{port}", "ip-literal"),
            ("0177.0.0.2:{port}", "ip-literal"),
            ("127.2:{port}", "ip-literal"),
            ("[::1]:{port}", "ip-literal"),
            ("[::ffff:127.0.0.2]:{port}", "ip-literal"),
            ("169.254.169.254:80", "ip-literal"),
            ("private.test:{port}", "non-public-address"),
            ("loopback.test:{port}", "non-public-address"),
            ("metadata.test:{port}", "non-public-address"),
            ("cgnat.test:{port}", "non-public-address"),
            ("mixed.test:{port}", "non-public-address"),
            ("mapped.test:{port}", "non-public-address"),
            ("nat64.test:{port}", "non-public-address"),
            ("victim.test:{port}", "non-public-address"),
            ("empty.test:{port}", "unresolvable"),
            ("nowhere.test:{port}", "unresolvable"),
            ("bad_name.test:{port}", "bad-request"),
        ],
    )
    def test_refusals_carry_their_code_and_tell_how_to_ask(self, proxy, net, world, target, code):
        target = target.format(port=net.tls.port)
        answer = connect(proxy, target, world[1])
        assert answer.headers.get("x-covey-deny-reason") == code, answer
        assert answer.status == {"unresolvable": 502}.get(code, 403)
        body = answer.body.decode()
        assert "covey refused" in body
        if code in ("not-on-allowlist", "port-not-allowed"):
            assert "ask for it" in body
            host, port = target.split(":")
            asked = host if port == "443" else target  # the entry as an allowlist writes it
            assert f'covey-request egress {asked} --reason "why the agent needs it"' in body
        if code == "non-public-address":  # no entry opens it: asking would be answered "allowed"
            assert "must allow that network" in body and "covey-request" not in body
        assert net.tls.connections == 0
        assert net.victim.connections == 0

    @pytest.mark.parametrize("target", ["good.test:0", "good.test:99999", "good.test:", ":443"])
    def test_malformed_connect_targets_go_nowhere(self, proxy, net, world, target):
        answer = connect(proxy, target, world[1])
        assert answer.status in (400, 403)
        assert net.tls.connections == 0

    def test_a_disabled_agent_is_refused(self, proxy, net, world):
        agent, credentials = world
        agent_services.update_agent(agent, enabled=False)
        proxy.sync()
        answer = connect(proxy, f"good.test:{net.tls.port}", credentials)
        assert (answer.status, answer.headers["x-covey-deny-reason"]) == (403, "agent-disabled")

    def test_names_are_normalised_before_matching(self, proxy, net, world):
        for target in ("GOOD.test", "good.test.", "Good.Test."):
            answer = connect(proxy, f"{target}:{net.tls.port}", world[1])
            assert answer.status == 200, target
            answer.sock.close()

    def test_every_decision_is_logged_with_its_reason(self, proxy, net, world):
        agent, credentials = world
        connect(proxy, "other.test:443", credentials)
        connect(proxy, f"private.test:{net.tls.port}", credentials)
        wait_for(lambda: Decision.objects.filter(agent=agent).count() >= 2, 10, "decisions logged")
        reasons = set(Decision.objects.filter(agent=agent).values_list("reason", flat=True))
        assert reasons == {"not-on-allowlist", "non-public-address"}
        row = Decision.objects.get(agent=agent, reason="non-public-address")
        assert row.detail == "10.1.2.3"


class TestTunnels:
    def tls_through(self, proxy, net, credentials, server_hostname, target=None):
        target = target or f"good.test:{net.tls.port}"
        answer = connect(proxy, target, credentials)
        assert answer.status == 200
        context = net.ca.client_context()
        if server_hostname is None:
            context.check_hostname = False
        return answer.sock, context

    def test_a_client_hello_for_another_name_closes_the_tunnel(self, proxy, net, world):
        sock, context = self.tls_through(proxy, net, world[1], None)
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            context.wrap_socket(sock, server_hostname="evil.test").do_handshake()
        assert net.tls.spoken == 0  # dialled, never sent a byte

    def test_a_client_hello_without_sni_closes_the_tunnel(self, proxy, net, world):
        sock, context = self.tls_through(proxy, net, world[1], None)
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            context.wrap_socket(sock, server_hostname=None).do_handshake()
        assert net.tls.spoken == 0  # dialled, never sent a byte

    @pytest.mark.parametrize(
        "first_bytes",
        [
            b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n",
            b"SSH-2.0-OpenSSH_9.2\r\n",
            b"\x16\x03\x09xx",
        ],
    )
    def test_bytes_that_are_not_tls_close_the_tunnel(self, proxy, net, world, first_bytes):
        answer = connect(proxy, f"good.test:{net.tls.port}", world[1])
        answer.sock.sendall(first_bytes)
        assert closed_by_peer(answer.sock)
        assert net.tls.spoken == 0  # dialled, never sent a byte

    def test_the_name_is_resolved_once_and_the_vetted_address_is_dialled(self, proxy, net, world):
        # Rebinding: the first answer is the allowed upstream, every later one a local victim.
        net.dns.sequence("rebind.test", [[UPSTREAM], [VICTIM]])
        before = net.dns.queries("rebind.test")
        with client(proxy, net, world[1]) as http:
            response = http.get(f"https://rebind.test:{net.tls.port}/")
        assert response.text == "hello from good"
        assert net.victim.connections == 0
        assert net.dns.queries("rebind.test") - before == 2  # one A and one AAAA query
        net.dns.set("rebind.test", UPSTREAM)

    def test_a_name_that_rebinds_to_a_private_address_is_refused(self, proxy, net, world):
        net.dns.sequence("rebind.test", [[VICTIM]])
        answer = connect(proxy, f"rebind.test:{net.tls.port}", world[1])
        assert answer.headers["x-covey-deny-reason"] == "non-public-address"
        net.dns.set("rebind.test", UPSTREAM)

    def test_large_transfers_pass_and_are_counted(self, proxy, net, world):
        agent, credentials = world
        size = 20 * 1024 * 1024
        with client(proxy, net, credentials) as http:
            response = http.get(f"https://good.test:{net.tls.port}/bytes/{size}")
        assert len(response.content) == size

        def counted():
            row = Decision.objects.filter(agent=agent, closed_at__isnull=False).first()
            return row is not None and row.bytes_down > size

        wait_for(counted, 10, "the byte count in the log")

    def test_an_upstream_that_refuses_closes_the_tunnel(self, proxy, net, world):
        agent, credentials = world
        closed_port = free_port()  # nothing listens there
        agent_services.update_agent(agent, allowlist=[*agent.allowlist, f"good.test:{closed_port}"])
        proxy.sync()
        answer = connect(proxy, f"good.test:{closed_port}", credentials)
        assert answer.status == 200  # decided; the upstream is dialled once the ClientHello passes
        tls = net.ca.client_context().wrap_socket(
            answer.sock, server_hostname="good.test", do_handshake_on_connect=False
        )
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            tls.do_handshake()

    def test_a_client_hello_in_pieces_is_checked_whole_and_sent_in_order(self, proxy, net, world):
        """The pieces reach the proxy before and while it dials the upstream."""
        answer = connect(proxy, f"good.test:{net.tls.port}", world[1])
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = net.ca.client_context().wrap_bio(incoming, outgoing, server_hostname="good.test")
        with pytest.raises(ssl.SSLWantReadError):
            tls.do_handshake()
        hello = outgoing.read()
        for i in range(0, len(hello), 50):  # the ClientHello in 50-byte pieces
            answer.sock.sendall(hello[i : i + 50])
            time.sleep(0.005)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                answer.sock.sendall(outgoing.read())
                incoming.write(answer.sock.recv(65536))
        tls.write(b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n")
        answer.sock.sendall(outgoing.read())
        received = b""
        while b"hello from good" not in received:
            incoming.write(answer.sock.recv(65536))
            with contextlib.suppress(ssl.SSLWantReadError):
                while True:  # every record the bytes so far complete
                    received += tls.read(65536)
        assert net.tls.connections == 1

    def test_large_uploads_arrive_intact_and_are_counted(self, proxy, net, world):
        agent, credentials = world
        body = os.urandom(12 * 1024 * 1024)
        with client(proxy, net, credentials) as http:
            response = http.post(f"https://good.test:{net.tls.port}/upload", content=body)
        assert response.status_code == 404  # the upstream has no such route, but read it all
        received = [r for r in net.tls.requests if r.path == "/upload"][-1]
        assert hashlib.sha256(received.body).digest() == hashlib.sha256(body).digest()

        def counted():
            row = Decision.objects.filter(agent=agent, closed_at__isnull=False).first()
            return row is not None and row.bytes_up > len(body)

        wait_for(counted, 10, "the byte count in the log")


class TestPlainHttp:
    def request(self, proxy, credentials, url, host="plain.test", extra=""):
        auth = f"Proxy-Authorization: {basic(credentials)}\r\n" if credentials else ""
        host_line = f"Host: {host}\r\n" if host is not None else ""
        raw = f"GET {url} HTTP/1.1\r\n{host_line}{auth}{extra}\r\n"
        return send(proxy, raw.encode())

    def test_plain_http_to_a_port_80_entry_is_forwarded_without_credentials(
        self, proxy, net, world
    ):
        answer = self.request(proxy, world[1], "http://plain.test/")
        assert answer.status == 200
        assert answer.body == b"hello from plain"
        seen = net.plain.last_request
        assert seen.host == "plain.test"
        assert seen.header("Proxy-Authorization") is None

    def test_plain_http_is_refused_to_entries_without_port_80(self, proxy, net, world):
        answer = self.request(
            proxy, world[1], f"http://good.test:{net.tls.port}/", host=f"good.test:{net.tls.port}"
        )
        assert answer.headers["x-covey-deny-reason"] == "port-not-allowed"

    @pytest.mark.parametrize(
        ("url", "host", "code"),
        [
            ("http://plain.test/", "evil.test", "bad-request"),  # Host disagrees with the URL
            ("http://evil.test/", "plain.test", "bad-request"),  # URL and Host disagree
            ("http://evil.test/", "evil.test", "not-on-allowlist"),
            ("http://plain.test@evil.test/", "evil.test", "bad-request"),  # userinfo
            ("http://evil.test@plain.test/", "plain.test", "bad-request"),
            ("http://127.0.0.5/", "plain.test", "bad-request"),
            ("http://plain.test:8080/", "plain.test:8080", "port-not-allowed"),
        ],
    )
    def test_host_confusion_is_refused(self, proxy, net, world, url, host, code):
        answer = self.request(proxy, world[1], url, host=host)
        assert answer.status in (400, 403)
        if answer.status == 403:
            assert answer.headers["x-covey-deny-reason"] in (code, "ip-literal")
        assert net.plain.requests == []

    def test_two_host_headers_are_refused(self, proxy, net, world):
        answer = self.request(proxy, world[1], "http://plain.test/", extra="Host: evil.test\r\n")
        assert answer.status in (400, 403)
        assert net.plain.requests == []

    def test_an_origin_form_request_is_decided_on_its_host_header(self, proxy, net, world):
        answer = self.request(proxy, world[1], "/", host="evil.test")
        assert answer.headers["x-covey-deny-reason"] == "not-on-allowlist"
        assert net.plain.requests == []
        assert self.request(proxy, world[1], "/", host=None).status == 400
        assert net.plain.requests == []


@pytest.mark.parametrize("change", ["disable", "revoke", "remove-entry"])
def test_open_tunnels_are_closed_when_the_policy_no_longer_allows_them(proxy, net, world, change):
    agent, credentials = world
    answer = connect(proxy, f"good.test:{net.tls.port}", credentials)
    tls = net.ca.client_context().wrap_socket(answer.sock, server_hostname="good.test")
    tls.sendall(b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n")
    assert b"200 OK" in tls.recv(65536)
    if change == "disable":
        agent_services.update_agent(agent, enabled=False)
    elif change == "revoke":
        revoke_tokens(agent.tokens.all())
    else:
        agent_services.update_agent(agent, allowlist=["plain.test:80"])
    started = time.monotonic()
    assert closed_by_peer(tls, timeout=5)
    assert time.monotonic() - started < 2.5  # the next policy poll plus the next tunnel check
    wait_for(
        lambda: Decision.objects.filter(agent=agent, allowed=False).exists(), 10, "the cut logged"
    )


@pytest.mark.parametrize("change", ["disable", "revoke", "remove-entry"])
def test_an_open_websocket_is_closed_when_the_policy_no_longer_allows_it(proxy, net, world, change):
    """A plain request upgraded to a WebSocket is a channel both ways, as a tunnel is: it is
    held to the policy from then on (and never to the head deadline)."""
    from tests.netfixtures import read_websocket_frame, websocket_frame

    agent, credentials = world
    sock = socket.create_connection(proxy.address, timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET http://plain.test/websocket HTTP/1.1\r\nHost: plain.test\r\n"
        f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: {key}\r\nProxy-Authorization: {basic(credentials)}\r\n\r\n".encode()
    )
    assert read_head(sock)[0] == 101
    frames = sock.makefile("rb")
    sock.sendall(websocket_frame(b"hello", mask=True))
    assert read_websocket_frame(frames) == b"hello"
    if change == "disable":
        agent_services.update_agent(agent, enabled=False)
    elif change == "revoke":
        revoke_tokens(agent.tokens.all())
    else:
        agent_services.update_agent(agent, allowlist=[f"good.test:{net.tls.port}"])
    started = time.monotonic()
    assert closed_by_peer(sock, timeout=5)
    assert time.monotonic() - started < 2.5  # the next policy poll plus the next check
    refused = Decision.objects.filter(agent=agent, allowed=False, host="plain.test", kind="http")
    wait_for(refused.exists, 10, "the cut logged")


def test_an_allowlist_change_is_enforced_within_a_second(proxy, net, world):
    agent, credentials = world
    target = "other.test:443"
    assert connect(proxy, target, credentials).status == 403
    agent_services.update_agent(agent, allowlist=[*agent.allowlist, target])
    started = time.monotonic()
    wait_for(lambda: connect(proxy, target, credentials).status == 200, 1.0, "the new entry")
    assert time.monotonic() - started < 1.0


def test_a_base_allowlist_change_reaches_every_agent(proxy, net, world):
    agent, credentials = world
    organisation_services.update_organisation(
        agent.organisation, base_allowlist=["api.anthropic.com", f"evil.test:{net.tls.port}"]
    )
    proxy.sync()
    assert connect(proxy, f"evil.test:{net.tls.port}", credentials).status == 200


def test_a_full_proxy_answers_429_and_recovers(net, tmp_path, django_db_setup, world):
    agent, credentials = world
    org = agent.organisation
    other = agent_services.create_agent(org, "second", allowlist=[f"good.test:{net.tls.port}"])
    _, other_credentials = issue_token(other)
    env = {"COVEY_EGRESS_MAX_TUNNELS": "3", "COVEY_EGRESS_MAX_TUNNELS_PER_AGENT": "2"}
    with start_proxy(tmp_path, net, **env) as small:
        small.sync()
        target = f"good.test:{net.tls.port}"
        held = [connect(small, target, credentials) for _ in range(2)]
        assert [a.status for a in held] == [200, 200]
        full = connect(small, target, credentials)
        assert (full.status, full.headers["x-covey-deny-reason"]) == (429, "capacity")
        assert full.headers["retry-after"] == "1"
        held.append(connect(small, target, other_credentials))  # the third, for another agent
        assert held[-1].status == 200
        assert connect(small, target, other_credentials).status == 429  # the proxy is full
        for answer in held:
            answer.sock.close()
        wait_for(lambda: connect(small, target, credentials).status == 200, 5, "a free slot")


def test_its_lines_about_an_agents_connection_carry_the_agents_id(net, tmp_path, world):
    agent, credentials = world
    closed_port = free_port()  # nothing listens there: "could not reach" is logged
    agent_services.update_agent(agent, allowlist=[*agent.allowlist, f"good.test:{closed_port}"])
    with start_proxy(tmp_path, net, COVEY_LOG_FORMAT="json") as proxy:
        proxy.sync()
        answer = connect(proxy, f"good.test:{closed_port}", credentials)
        assert answer.status == 200
        tls = net.ca.client_context().wrap_socket(
            answer.sock, server_hostname="good.test", do_handshake_on_connect=False
        )
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            tls.do_handshake()

        def said() -> list[dict]:
            output = proxy.output().splitlines()
            lines = [json.loads(line) for line in output if line.startswith("{")]
            return [line for line in lines if "could not reach" in line["message"]]

        wait_for(lambda: said(), 5, "the proxy saying it could not reach the upstream")
    assert [line.get("agent_id") for line in said()] == [agent.pk]


@pytest.mark.suite("faults")
def test_a_killed_proxy_leaves_no_gap_in_the_log_it_does_not_admit(net, tmp_path, world, cases):
    """Decisions are written in batches, so a proxy killed between two loses the last ones:
    its next start admits that (egress.models.ProxySession); a clean stop writes all and says
    how many. Every refusal a client saw is in the log or inside an admitted gap."""
    _, credentials = world
    name = f"gap-{secrets.token_hex(4)}"

    def refused(proxy, count: int) -> int:
        seen = 0
        for i in range(count):
            answer = connect(proxy, f"off-list-{i}.test:443", credentials)
            assert answer.status == 403, answer
            answer.sock.close()
            seen += 1
        return seen

    def session(proxy_name: str, position: int) -> ProxySession:
        return ProxySession.objects.filter(proxy=proxy_name).order_by("started_at")[position]

    def logged() -> int:
        return Decision.objects.filter(proxy=name).count()

    with start_proxy(tmp_path, net, EXTRA_ARGS=f"--name {name}") as first:
        first.sync()
        seen = refused(first, 100)
        wait_for(lambda: logged() == seen, 10, "the first batches written")
        seen += refused(first, 100)
        assert first.process is not None
        os.killpg(first.process.pid, signal.SIGKILL)  # no stop, no last flush
        first.process.wait()
    with start_proxy(tmp_path, net, EXTRA_ARGS=f"--name {name}") as second:
        second.sync()
        wait_for(
            lambda: ProxySession.objects.filter(proxy=name).count() == 2,
            10,
            "the second session",
            second.log,
        )
        killed = session(name, 0)
        assert killed.end == ProxySession.End.LOST and killed.ended_at is not None
        # What is in the log is what it counts; the rest of what clients saw is after it.
        assert killed.recorded == logged() == killed.made <= seen
        assert killed.made >= 100
        assert f"decisions after no. {killed.made} are unknown" in killed.gap
        cases.add()
        cases.note(
            f"proxy killed after {seen} refusals: {killed.recorded} in the log,"
            f" {seen - killed.recorded} admitted as unknown (after no. {killed.made})"
        )
        before = logged()
        seen_second = refused(second, 50)
    # The block's end stopped it cleanly (SIGTERM): all of it written, and said so.
    stopped = session(name, 1)
    assert stopped.end == ProxySession.End.STOPPED, stopped.gap
    assert stopped.made == stopped.recorded == seen_second == logged() - before
    assert stopped.gap == ""
    cases.add()


@pytest.mark.suite("faults")
def test_it_fails_closed_when_the_database_is_gone(net, tmp_path, django_db_setup, world):
    _, credentials = world
    # A policy source that answers once, then never again: a proxy pointed at a port we close.
    relay = socket.create_server(("127.0.0.1", 0))
    port = relay.getsockname()[1]
    relay.close()  # nothing listens there now
    env = {
        "COVEY_EGRESS_POLICY_GRACE": "1",
        "EXTRA_ARGS": f"--control-plane http://127.0.0.1:{port} --runner-token covey-run-nothing",
    }
    with start_proxy(tmp_path, net, **env) as blind:
        answer = connect(blind, f"good.test:{net.tls.port}", credentials)
        assert (answer.status, answer.headers["x-covey-deny-reason"]) == (
            503,
            "policy-unavailable",
        )


class TestConnectLayer:
    """A connection that opens with CONNECT is answered by covey's front door; one that opens
    with a plain request gets mitmproxy's HTTP layer, CONNECTs after it included."""

    def handshake(self, net, sock):
        tls = net.ca.client_context().wrap_socket(sock, server_hostname="good.test")
        tls.sendall(b"GET / HTTP/1.1\r\nHost: good.test\r\nConnection: close\r\n\r\n")
        status, _, body = read_head(tls)
        tls.close()
        return status, body

    def test_a_connect_sent_in_pieces_is_read_whole(self, proxy, net, world):
        target = f"good.test:{net.tls.port}"
        sock = socket.create_connection(proxy.address, timeout=10)
        head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        head += f"Proxy-Authorization: {basic(world[1])}\r\n\r\n"
        for piece in (head[:4], head[4:9], head[9:40], head[40:]):
            sock.sendall(piece.encode())
            time.sleep(0.05)
        assert read_head(sock)[0] == 200
        assert self.handshake(net, sock) == (200, b"hello from good")

    @pytest.mark.parametrize(
        "head",
        [
            b"CONNECT good.test HTTP/1.1\r\n\r\n",  # no port
            b"CONNECT good.test:99999 HTTP/1.1\r\n\r\n",
            b"CONNECT  HTTP/1.1\r\n\r\n",
            b"CONNECT good.test:443 HTTP/1.1\r\nbroken header line\r\n\r\n",
        ],
    )
    def test_a_malformed_connect_is_answered_400_and_closed(self, proxy, net, world, head):
        answer = send(proxy, head)
        assert answer.status == 400, answer
        assert answer.headers["connection"] == "close"
        assert closed_by_peer(answer.sock)
        assert net.tls.connections == 0

    def test_a_head_that_never_ends_is_refused(self, proxy, net, world):
        sock = socket.create_connection(proxy.address, timeout=10)
        sock.sendall(b"CONNECT good.test:443 HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError):
            sock.sendall(b"X-Padding: " + b"x" * (70 * 1024) + b"\r\n")
        status, _, _ = read_head(sock)
        assert status == 400
        assert closed_by_peer(sock)

    def test_a_refused_connect_closes_the_connection(self, proxy, net, world):
        answer = connect(proxy, f"evil.test:{net.tls.port}", world[1])
        assert (answer.status, answer.headers["x-covey-deny-reason"]) == (403, "not-on-allowlist")
        assert answer.headers["connection"] == "close"
        assert b"ask for it" in answer.body
        assert closed_by_peer(answer.sock)

    def test_a_connect_after_a_plain_request_is_decided_too(self, proxy, net, world):
        auth = f"Proxy-Authorization: {basic(world[1])}\r\n"
        plain = send(
            proxy, f"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n{auth}\r\n".encode()
        )
        assert (plain.status, plain.body) == (200, b"hello from plain")
        target = f"good.test:{net.tls.port}"
        tunnel = send(
            proxy, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode(), plain.sock
        )
        assert tunnel.status == 200
        assert self.handshake(net, tunnel.sock) == (200, b"hello from good")

    def test_a_kept_name_is_not_asked_again_and_its_addresses_are_still_vetted(
        self, proxy, net, world
    ):
        port = net.tls.port
        net.dns.set("good.test", UPSTREAM, ttl=60)
        net.dns.set("private.test", "10.1.2.3", ttl=60)
        try:
            good_before = net.dns.queries("good.test")
            private_before = net.dns.queries("private.test")
            for _ in range(3):
                answer = connect(proxy, f"good.test:{port}", world[1])
                assert answer.status == 200
                assert self.handshake(net, answer.sock) == (200, b"hello from good")
                refused = connect(proxy, f"private.test:{port}", world[1])
                assert refused.headers["x-covey-deny-reason"] == "non-public-address"
            # One A and one AAAA query each: the later decisions used what was kept.
            assert net.dns.queries("good.test") - good_before == 2
            assert net.dns.queries("private.test") - private_before == 2
        finally:
            net.dns.set("good.test", UPSTREAM)
            net.dns.set("private.test", "10.1.2.3")


def test_a_token_issued_after_the_last_poll_works_from_the_first_byte(
    net, tmp_path, django_db_setup, world
):
    """A run's credential is made moments before its sandbox's first request: a proxy that has
    not polled since asks its policy source once instead of answering 407 (issue 9, item 7)."""
    agent, _ = world
    target = f"good.test:{net.tls.port}"
    with start_proxy(
        tmp_path, net, COVEY_EGRESS_POLICY_POLL="600", COVEY_EGRESS_POLICY_GRACE="1200"
    ) as slow:
        slow.sync()
        statuses = []
        for _ in range(12):  # none of these tokens was in the policy the proxy holds
            _, fresh = issue_token(agent)
            answer = connect(slow, target, fresh)
            statuses.append(answer.status)
            answer.sock.close()
        assert statuses == [200] * 12
        # A plain-HTTP request with a fresh token is looked up the same way.
        _, fresh = issue_token(agent)
        with httpx.Client(proxy=slow.url(fresh), timeout=10) as http:
            assert http.get("http://plain.test/").status_code == 200
        # A token nobody issued is still refused (how often it is asked about: test_feed.py).
        bogus = f"{agent.slug}:{secrets.token_urlsafe(32)}"  # shaped like one: it is looked up
        answers = [connect(slow, target, bogus) for _ in range(3)]
        assert [a.status for a in answers] == [407, 407, 407]


def test_a_plain_answer_reaches_the_client_as_it_comes_not_when_it_ends(proxy, net, world):
    """A streamed answer (the model gateway's, under hard isolation) is never held whole."""
    more = threading.Event()
    listener = socket.create_server((UPSTREAM, 80))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while b"\r\n\r\n" not in conn.recv(65536):
                pass
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            more.wait(10)
            conn.sendall(b"4\r\nlast\r\n0\r\n\r\n")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        net.dns.set("stream.test", UPSTREAM)
        agent = agent_services.create_agent(
            world[0].organisation, "streamer", allowlist=["stream.test:80"]
        )
        _, credentials = issue_token(agent)
        proxy.sync()
        sock = socket.create_connection(proxy.address, timeout=5)
        auth = f"Proxy-Authorization: {basic(credentials)}\r\n"
        request = f"GET http://stream.test/ HTTP/1.1\r\nHost: stream.test\r\n{auth}\r\n"
        sock.sendall(request.encode())
        seen = b""
        while b"first" not in seen:  # before the upstream sends the rest
            seen += sock.recv(65536)
        more.set()
        while not seen.endswith(b"0\r\n\r\n"):
            seen += sock.recv(65536)
        assert b"last" in seen
    finally:
        more.set()
        listener.close()
        server.join(10)
