"""covey's front door (egress/proxy/front.py) on real loopback sockets, with a small fake
:class:`Gate` in place of the addon: a client, the front, and a TCP upstream of the test's own.
The real proxy, addon included, is tested end to end in test_proxy.py and the security suite."""

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.net.http import http1

from egress.policy import AgentPolicy, Attempt, Code, Decision
from egress.proxy import front as front_module
from egress.proxy.front import CONNECTED, MAX_HEAD, Front, Gate, read_connect
from egress.proxy.lookups import LookUp
from egress.proxy.tunnels import Tunnel

AGENT = AgentPolicy(7, "acme.builder", "acme", True, False, ())
HELLO = b"\x16\x03\x01 a ClientHello naming good.test"
WAIT = 5.0  # seconds any step may take on a busy machine


def allowed(port: int, address: str | None = "127.0.0.1") -> Decision:
    return Decision(Code.ALLOWED, "good.test", port, "acme.builder", agent=AGENT, address=address)


@dataclass
class FakeGate:
    """A :class:`Gate` that answers as told and remembers what the front asked."""

    first: Decision | LookUp | None = None  # None: allowed, to the test's upstream
    later: Callable[[], Awaitable[Decision]] | None = None  # what settle answers
    hello_ok: Callable[[bytes], bool | None] = lambda data: (
        True if data.startswith(HELLO) else None if HELLO.startswith(data) else False
    )
    upstream_port: int = 0
    opened_ids: list[str] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    asked: list[Attempt] = field(default_factory=list)
    settled: list[Decision | LookUp] = field(default_factory=list)
    admitted: list[Tunnel] = field(default_factory=list)
    hellos: list[bytes] = field(default_factory=list)
    closed_ids: list[str] = field(default_factory=list)

    def opened(self, client_id: str) -> None:
        self.opened_ids.append(client_id)

    def head_came(self, client_id: str) -> None:
        self.heads.append(client_id)

    def decide_now(self, attempt: Attempt, client: str) -> Decision | LookUp:
        assert client == "127.0.0.1"
        self.asked.append(attempt)
        return self.first or allowed(self.upstream_port)

    async def settle(self, attempt: Attempt, pending: Decision | LookUp) -> Decision:
        self.settled.append(pending)
        assert self.later is not None
        return await self.later()

    def admit(self, client_id: str, attempt: Attempt, decision: Decision) -> Tunnel | None:
        tunnel = Tunnel("d1", attempt.to(decision), decision)
        self.admitted.append(tunnel)
        return tunnel

    def check_hello(self, tunnel: Tunnel, data: bytes) -> bool | None:
        self.hellos.append(data)
        checked = self.hello_ok(data)
        tunnel.started = bool(checked)
        return checked

    def closed(self, client_id: str) -> None:
        self.closed_ids.append(client_id)


def _typed(gate: FakeGate) -> Gate:
    return gate  # mypy checks here that the fake is a Gate


def connect_head(target: str = "good.test:443") -> bytes:
    return (
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        "Proxy-Authorization: Basic YWNtZS5idWlsZGVyOnQ=\r\n\r\n"
    ).encode()


class Scene:
    """A front on a free loopback port, a TCP upstream, and what the plain handler got."""

    def __init__(self, gate: FakeGate, idle_seconds: float = 600.0) -> None:
        self.gate = gate
        self.plain: list[bytes] = []
        self.upstream = socket.create_server(("127.0.0.1", 0))
        self.upstream.setblocking(False)
        gate.upstream_port = self.upstream.getsockname()[1]
        self.front = Front(_typed(gate), self._plain, idle_seconds=idle_seconds)
        self.front.bind("127.0.0.1", 0)
        self.front.start()
        self.port = self.front.addresses[0][1]

    async def _plain(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.plain.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 204 Plain\r\n\r\n")
        await writer.drain()
        writer.close()

    async def client(self, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        if data:
            writer.write(data)
        return reader, writer

    async def accepted(self) -> socket.socket:
        """The upstream's side of the next connection the front dials."""
        async with asyncio.timeout(WAIT):
            sock, _ = await asyncio.get_running_loop().sock_accept(self.upstream)
        sock.setblocking(False)
        return sock

    def nothing_dialled(self) -> bool:
        try:
            self.upstream.accept()[0].close()
        except BlockingIOError:
            return True
        return False

    def close(self) -> None:
        self.front.stop()
        self.upstream.close()


def run(gate: FakeGate, scenario: Callable[[Scene], Coroutine[Any, Any, None]], **kw: Any) -> None:
    async def main() -> None:
        scene = Scene(gate, **kw)
        try:
            async with asyncio.timeout(30):
                await scenario(scene)
        finally:
            scene.close()

    asyncio.run(main())


async def answer(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(WAIT):
        return await reader.readuntil(b"\r\n\r\n")


async def body_to_end(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(WAIT):
        return await reader.read()  # until the front closes


async def upstream_gets(sock: socket.socket, size: int) -> bytes:
    loop, data = asyncio.get_running_loop(), b""
    async with asyncio.timeout(WAIT):
        while len(data) < size:
            more = await loop.sock_recv(sock, 65536)
            if not more:
                break
            data += more
    return data


async def settles(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.005)


def test_an_allowed_tunnel_is_answered_200_its_client_hello_goes_first_then_both_ways():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        assert await answer(reader) == CONNECTED
        (attempt,) = gate.asked
        assert (attempt.host, attempt.port) == ("good.test", 443)
        assert attempt.credential == "Basic YWNtZS5idWlsZGVyOnQ="
        upstream = await scene.accepted()  # dialled while the ClientHello is on its way
        writer.write(HELLO + b" and more")
        assert await upstream_gets(upstream, len(HELLO) + 9) == HELLO + b" and more"
        await asyncio.get_running_loop().sock_sendall(upstream, b"server bytes")
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(12) == b"server bytes"
        writer.write(b"client bytes")
        assert await upstream_gets(upstream, 12) == b"client bytes"
        (tunnel,) = gate.admitted
        assert tunnel.totals() == (len(HELLO) + 9 + 12, 12)
        door_id = gate.opened_ids[0]
        assert gate.heads == [door_id] and gate.closed_ids == []
        upstream.close()  # the server ends: the client is told (a half-close)
        assert await body_to_end(reader) == b""
        assert gate.closed_ids == []
        writer.close()  # and once the client ends too, so does the tunnel
        await settles(lambda: gate.closed_ids == [door_id])
        assert scene.front.doors == {}

    run(gate, scenario)


def test_a_head_that_comes_in_pieces_is_decided_once_it_is_whole():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        head = connect_head()
        reader, writer = await scene.client(head[:3])  # not yet even the method
        for piece in (head[3:20], head[20:-1]):
            await asyncio.sleep(0.05)
            writer.write(piece)
        await asyncio.sleep(0.05)
        assert gate.asked == []
        writer.write(head[-1:])
        assert await answer(reader) == CONNECTED
        assert len(gate.asked) == 1
        writer.close()

    run(gate, scenario)


def test_a_refused_connect_is_answered_with_its_reason_and_closed_never_dialled():
    gate = FakeGate(first=allowed(443).refuse(Code.NOT_ON_ALLOWLIST))

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        head = await answer(reader)
        assert head.startswith(b"HTTP/1.1 403 ")
        assert b"X-Covey-Deny-Reason: not-on-allowlist\r\n" in head
        assert b"Connection: close\r\n" in head
        assert b"covey refused good.test:443" in await body_to_end(reader)
        assert gate.admitted == [] and gate.hellos == []
        await settles(lambda: len(gate.closed_ids) == 1)
        assert scene.nothing_dialled()
        writer.close()

    run(gate, scenario)


def test_a_connect_that_must_wait_answers_nothing_before_its_decision():
    gate = FakeGate(first=LookUp("token-hash", "127.0.0.1"))
    release: list[asyncio.Event] = []

    async def later() -> Decision:
        release.append(asyncio.Event())
        await release[0].wait()
        return allowed(gate.upstream_port)

    gate.later = later

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        await settles(lambda: bool(release))
        writer.write(HELLO)  # sent ahead: it waits in the socket for the decision
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await reader.read(1)
        assert gate.settled == [gate.first] and gate.admitted == [] and gate.hellos == []
        release[0].set()
        assert await answer(reader) == CONNECTED
        upstream = await scene.accepted()
        assert await upstream_gets(upstream, len(HELLO)) == HELLO
        assert gate.hellos == [HELLO]
        writer.close()
        upstream.close()

    run(gate, scenario)


@pytest.mark.parametrize("outcome", ["refused", "failed"])
def test_a_decision_that_refuses_or_fails_later_is_refused(outcome):
    gate = FakeGate(first=allowed(0, address=None))  # allowed by name: the name to resolve

    async def later() -> Decision:
        if outcome == "failed":
            raise RuntimeError("the resolver broke")
        return allowed(0).refuse(Code.NON_PUBLIC_ADDRESS)

    gate.later = later
    code = b"non-public-address" if outcome == "refused" else b"bad-request"

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        head = await answer(reader)
        assert head.startswith(b"HTTP/1.1 403 ") and b"X-Covey-Deny-Reason: " + code in head
        await body_to_end(reader)
        assert gate.admitted == [] and scene.nothing_dialled()
        writer.close()

    run(gate, scenario)


@pytest.mark.parametrize(
    ("opening", "why"),
    [
        (b"CONNECT  HTTP/1.1\r\n\r\n", b"bad request"),
        (b"CONNECT good.test:443 HTTP/1.1\r\nbroken header line\r\n\r\n", b"bad request"),
        (b"CONNECT " + b"a" * MAX_HEAD + b"a", b"too large"),
    ],
)
def test_a_broken_connect_head_is_answered_400_and_closed(opening, why):
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(opening)
        head = await answer(reader)
        assert head.startswith(b"HTTP/1.1 400 ")
        assert why in await body_to_end(reader)
        assert gate.asked == [] and gate.admitted == []
        writer.close()

    run(gate, scenario)


@pytest.mark.parametrize("split", [1, 5, 200])
def test_a_connection_that_does_not_open_with_connect_goes_whole_to_the_plain_handler(split):
    gate = FakeGate()
    request = b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n\r\n"

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(request[:split])
        await asyncio.sleep(0.05)
        writer.write(request[split:])
        assert await answer(reader) == b"HTTP/1.1 204 Plain\r\n\r\n"
        assert scene.plain == [request]  # every byte, those the front read first included
        assert gate.asked == [] and scene.front.doors == {}
        assert gate.closed_ids == gate.opened_ids  # the front's own record of it ends
        writer.close()

    run(gate, scenario)


def test_a_tunnel_whose_first_bytes_are_refused_is_closed_and_the_upstream_gets_no_byte():
    gate = FakeGate(hello_ok=lambda data: False)

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        assert await answer(reader) == CONNECTED
        upstream = await scene.accepted()
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await body_to_end(reader) == b""
        assert await upstream_gets(upstream, 1) == b""  # closed without a byte
        assert gate.hellos == [b"GET / HTTP/1.1\r\n\r\n"]
        await settles(lambda: len(gate.closed_ids) == 1)
        writer.close()
        upstream.close()

    run(gate, scenario)


def test_a_client_that_goes_before_its_hello_closes_the_tunnel_and_its_dial():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head() + HELLO[:5])
        assert await answer(reader) == CONNECTED
        upstream = await scene.accepted()
        writer.close()
        assert await upstream_gets(upstream, 1) == b""
        await settles(lambda: len(gate.closed_ids) == 1)
        assert gate.hellos == [HELLO[:5]]
        upstream.close()

    run(gate, scenario)


def test_an_upstream_that_refuses_the_dial_closes_the_tunnel():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            gate.first = allowed(unused.getsockname()[1])
        reader, writer = await scene.client(connect_head() + HELLO)
        assert await answer(reader) == CONNECTED
        assert await body_to_end(reader) == b""
        await settles(lambda: len(gate.closed_ids) == 1)
        writer.close()

    run(gate, scenario)


def test_a_tunnel_closed_from_outside_ends_at_once_and_an_unknown_id_is_not_closed():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head() + HELLO)
        assert await answer(reader) == CONNECTED
        upstream = await scene.accepted()
        assert await upstream_gets(upstream, len(HELLO)) == HELLO
        assert not scene.front.close("no-such-client")
        assert scene.front.close(gate.opened_ids[0])  # what the policy's recheck does
        assert await body_to_end(reader) == b""
        assert await upstream_gets(upstream, 1) == b""
        assert gate.closed_ids == gate.opened_ids
        writer.close()
        upstream.close()

    run(gate, scenario)


def test_a_tunnel_that_moves_no_bytes_for_its_idle_time_is_closed(monkeypatch):
    monkeypatch.setattr(front_module, "IDLE_CHECK_SECONDS", 0.05)
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head() + HELLO)
        assert await answer(reader) == CONNECTED
        upstream = await scene.accepted()
        for _ in range(4):  # bytes keep it open past its idle time
            await asyncio.sleep(0.1)
            writer.write(b"x")
            await upstream_gets(upstream, 1)
        assert gate.closed_ids == []
        assert await body_to_end(reader) == b""  # then quiet: closed
        assert gate.closed_ids == gate.opened_ids
        writer.close()
        upstream.close()

    run(gate, scenario, idle_seconds=0.25)


def test_stop_accepts_no_more_and_closes_every_tunnel():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        assert await answer(reader) == CONNECTED
        scene.front.stop()
        assert await body_to_end(reader) == b""
        assert gate.closed_ids == gate.opened_ids
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", scene.port)
        writer.close()

    run(gate, scenario)


def test_bind_fails_loudly_on_a_port_in_use_and_holds_nothing():
    async def scenario() -> None:
        with socket.create_server(("127.0.0.1", 0)) as taken:
            front = Front(_typed(FakeGate()), lambda reader, writer: asyncio.sleep(0))
            with pytest.raises(OSError):
                front.bind("127.0.0.1", taken.getsockname()[1])
            assert front.listeners == []

    asyncio.run(scenario())


def test_a_client_that_resets_mid_head_leaves_nothing_behind():
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        sock = socket.create_connection(("127.0.0.1", scene.port))
        sock.sendall(connect_head()[:10])
        await settles(lambda: len(gate.opened_ids) == 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # RST
        await settles(lambda: gate.closed_ids == gate.opened_ids)
        assert scene.front.doors == {}
        with contextlib.suppress(OSError):
            sock.close()

    run(gate, scenario)


HEADS = [
    b"CONNECT good.test:443 HTTP/1.1\r\nHost: good.test:443\r\nProxy-Authorization: Basic YQ==",
    b"CONNECT good.test:443 HTTP/1.0",
    b"CONNECT GOOD.test:8443 HTTP/1.1\r\nproxy-authorization:   Basic  x  ",
    b"CONNECT good.test:443 HTTP/1.1\r\nProxy-Authorization: a\r\nPROXY-AUTHORIZATION: b",
    b"CONNECT good.test:443 HTTP/1.1\r\nProxy-Authorization: a\r\n  continued\r\nX: y",
    b"CONNECT good.test:443 HTTP/1.1\r\nX: y\r\n\tcontinued\r\nProxy-Authorization: a",
    b"CONNECT good.test:443 HTTP/1.1\r\n continuation first",
    b"CONNECT good.test:443 HTTP/1.1\r\nno colon",
    b"CONNECT good.test:443 HTTP/1.1\r\n: empty name",
    b"CONNECT good.test:443 HTTP/1.1\r\nProxy-Authorization: caf\xc3\xa9 \xff",
    b"CONNECT good.test:443 HTTP/1.1\r\nProxy-Authorization;x: a",
    b"CONNECT good.test:443 HTTP/3.0",
    b"CONNECT good.test:443 HTTP/1.1 extra",
    b"CONNECT good.test:443",
    b"CONNECT  HTTP/1.1",
    b"CONNECT good.test HTTP/1.1",
    b"CONNECT good.test: HTTP/1.1",
    b"CONNECT :443 HTTP/1.1",
    b"CONNECT good.test:0 HTTP/1.1",
    b"CONNECT good.test:99999 HTTP/1.1",
    b"CONNECT good.test:44x HTTP/1.1",
    b"CONNECT [::1]:443 HTTP/1.1",
    b"CONNECT 127.0.0.1:443 HTTP/1.1",
    b"CONNECT bad_name.test:443 HTTP/1.1",
    b"CONNECT -bad.test:443 HTTP/1.1",
    b"CONNECT good.test:443\tHTTP/1.1",
    b"CONNECT xn--caf-dma.test:443 HTTP/1.1",
    b"CONNECT caf\xc3\xa9.test:443 HTTP/1.1",
    b"CONNECT good.test:443 HTTP/1.1\r\nHost: a\nb",
    b"CONNECT /good.test:443 HTTP/1.1",
    b"CONNECT * HTTP/1.1",
]


@pytest.mark.parametrize("head", HEADS)
def test_a_connect_head_reads_as_mitmproxys_parser_reads_it(head):
    """read_connect against mitmproxy's own parser, which it stands in for: the same refusals,
    the same target and credential."""
    assert _read(head) == _mitmproxys_reading(head)


def _mitmproxys_reading(head: bytes) -> tuple[str, int, str | None] | None:
    """What mitmproxy's parser reads; None for what it refuses, and for a target it reads as
    no host (an origin form, ``*``), which no CONNECT can go to: read_connect refuses it."""
    try:
        request = http1.read_request_head(head.split(b"\r\n"))
    except ValueError:
        return None
    if not request.host:
        return None
    return request.host, request.port, request.headers.get("Proxy-Authorization")


def _read(head: bytes) -> tuple[str, int, str | None] | None:
    try:
        return read_connect(head)
    except ValueError:
        return None


# Targets around what the parser's checks decide: labels of every length around the limits, ACE
# labels, brackets, colons, non-ASCII, long ports and names, origin forms and ``*``.
LABEL = st.one_of(
    st.text("abcXYZ019-_", min_size=0, max_size=66),
    st.sampled_from(["xn--caf-dma", "XN--bad", "xn--", "a" * 63, "a" * 64, "[::1]", "é"]),
)
TARGET = st.builds(
    lambda start, labels, times, dot, sep, port: (
        start + ".".join(labels * times) + dot + sep + port
    ),
    st.sampled_from(["", "", "", "/", "*", "http://"]),
    st.lists(LABEL, min_size=1, max_size=4),
    st.integers(1, 8),  # names past 255 characters too
    st.sampled_from(["", "."]),
    st.sampled_from([":", ":", ":", "", "::", ":+"]),
    st.one_of(
        st.sampled_from(["0", "1", "443", "65535", "65536", "99999", "00443", "٣"]),
        st.integers(0, 70000).map(str),
        st.text("0123456789x ", max_size=7),
    ),
)


@settings(max_examples=500, deadline=None)  # a busy machine may pause any one example
@given(target=TARGET)
def test_a_connect_target_reads_as_mitmproxys_parser_reads_it(target):
    head = b"CONNECT " + target.encode() + b" HTTP/1.1\r\nProxy-Authorization: Basic YQ=="
    assert _read(head) == _mitmproxys_reading(head)


def test_a_bound_front_refuses_clients_until_it_starts():
    async def scenario() -> None:
        front = Front(_typed(FakeGate()), lambda reader, writer: asyncio.sleep(0))
        front.bind("127.0.0.1", 0)
        try:
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", front.addresses[0][1])
            front.start()
            _, writer = await asyncio.open_connection("127.0.0.1", front.addresses[0][1])
            writer.close()
        finally:
            front.stop()

    asyncio.run(scenario())


def test_bytes_sent_with_the_head_and_the_hello_all_reach_the_upstream_in_order():
    """A client that sends its head, its ClientHello and a lot more at once: nothing is read
    past the ClientHello before the relay, and every byte arrives once, in order."""
    gate = FakeGate()
    payload = os.urandom(8 * 1024 * 1024)

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head() + HELLO + payload)
        upstream = await scene.accepted()
        await asyncio.sleep(0.3)  # the client's bytes pile up: the door must not read them
        assert len(scene.front.doors[gate.opened_ids[0]].buffer) < 64 * 1024
        got = await upstream_gets(upstream, len(HELLO) + len(payload))
        assert got == HELLO + payload
        assert await answer(reader) == CONNECTED
        writer.close()
        upstream.close()

    run(gate, scenario)


def test_a_failure_inside_a_door_closes_it_and_forgets_it():
    gate = FakeGate()

    def broken(attempt: Attempt, client: str) -> Decision | LookUp:
        raise RuntimeError("a bug")

    gate.decide_now = broken

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        assert await body_to_end(reader) == b""  # closed, nothing said
        await settles(lambda: gate.closed_ids == gate.opened_ids)
        assert scene.front.doors == {} and scene.plain == []
        writer.close()

    run(gate, scenario)


def test_the_client_hello_is_awaited_only_as_long_as_a_head():
    """The deadline of a head goes on until the ClientHello passes: the addon closes a door
    still in its ``heads`` when the time is up (here, the test does)."""
    gate = FakeGate()

    async def scenario(scene: Scene) -> None:
        reader, writer = await scene.client(connect_head())
        assert await answer(reader) == CONNECTED
        await scene.accepted()
        assert gate.heads == []  # still awaited
        writer.write(HELLO)
        await settles(lambda: gate.heads == gate.opened_ids)  # no deadline from here
        writer.close()

    run(gate, scenario)


def test_a_port_bound_twice_fails_at_the_second_listen():
    """Linux lets two sockets with SO_REUSEADDR bind one port while neither listens: the
    second to listen fails (the proxy then stops, saying why: egress/proxy/server.py)."""

    async def scenario() -> None:
        first = Front(_typed(FakeGate()), lambda reader, writer: asyncio.sleep(0))
        second = Front(_typed(FakeGate()), lambda reader, writer: asyncio.sleep(0))
        first.bind("127.0.0.1", 0)
        try:
            second.bind("127.0.0.1", first.addresses[0][1])  # neither listens yet: Linux allows it
            first.start()
            with pytest.raises(OSError):
                second.start()
        finally:
            first.stop()
            second.stop()

    asyncio.run(scenario())
