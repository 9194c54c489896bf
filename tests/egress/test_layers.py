"""covey's protocol layers (egress/proxy/layers.py) without a proxy process: each layer is fed
mitmproxy events and its commands are checked, with a small fake :class:`Gate` in place of the
addon. Milliseconds each.

:class:`Driver` does for a layer what mitmproxy's own ``Playbook`` does in its tests
(test/mitmproxy/proxy/tutils.py in the mitmproxy repository; its wheel does not ship it): it
hands the layer one event at a time, keeps the client connection's state as mitmproxy's server
would after each command, and answers a blocking hook with ``HookCompleted``.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from mitmproxy import connection, options
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context

from egress.policy import AgentPolicy, Attempt, Code, Decision
from egress.proxy.layers import (
    CONNECTED,
    MAX_HEAD,
    Connect,
    CoveyDecideHook,
    Gate,
    Passthrough,
)
from egress.proxy.lookups import LookUp
from egress.proxy.tunnels import Tunnel

AGENT = AgentPolicy(7, "acme.builder", "acme", True, False, ())
HELLO = b"\x16\x03\x01 a ClientHello naming good.test"


def allowed(host: str = "good.test", port: int = 443, address: str | None = "203.0.113.9"):
    return Decision(Code.ALLOWED, host, port, "acme.builder", agent=AGENT, address=address)


@dataclass
class FakeGate:
    """A :class:`Gate` that answers as told and remembers what the layers asked."""

    first: Decision | LookUp = field(default_factory=allowed)
    hello: Callable[[bytes], bool | None] = lambda data: (
        True if data.startswith(HELLO) else None if HELLO.startswith(data) else False
    )
    heads: list[str] = field(default_factory=list)
    asked: list[Attempt] = field(default_factory=list)
    admitted: list[Tunnel] = field(default_factory=list)
    hellos: list[bytes] = field(default_factory=list)
    handed: list[tuple[str, Tunnel, Callable[[], bytes | None]]] = field(default_factory=list)

    def head_came(self, client_id: str) -> None:
        self.heads.append(client_id)

    def decide_now(self, attempt: Attempt, client: str) -> Decision | LookUp:
        self.asked.append(attempt)
        return self.first

    def admit(self, client_id: str, attempt: Attempt, decision: Decision) -> Tunnel | None:
        tunnel = Tunnel("d1", attempt.to(decision), decision)
        self.admitted.append(tunnel)
        return tunnel

    def check_hello(self, tunnel: Tunnel, data: bytes) -> bool | None:
        self.hellos.append(data)
        checked = self.hello(data)
        tunnel.started = bool(checked)
        return checked

    def tunnel_of(self, client_id: str) -> Tunnel | None:
        return self.admitted[-1] if self.admitted else None

    def hand_over(self, client_id: str, tunnel: Tunnel, early: Callable[[], bytes | None]) -> None:
        self.handed.append((client_id, tunnel, early))


def _typed(gate: FakeGate) -> Gate:
    return gate  # mypy checks here that the fake is a Gate


class Driver:
    """Feeds a layer events and collects what it does, as mitmproxy's server would."""

    def __init__(self, make: Callable[[Context], layer.Layer]) -> None:
        client = connection.Client(
            peername=("10.0.0.2", 40000), sockname=("10.0.0.1", 3128), timestamp_start=time.time()
        )
        client.state = ConnectionState.OPEN
        self.context = Context(client, options.Options())
        self.layer = make(self.context)
        assert self.send(events.Start()) == []

    @property
    def client(self) -> connection.Client:
        return self.context.client

    def send(self, event: events.Event) -> list[commands.Command]:
        done = list(self.layer.handle_event(event))
        for command in done:
            if isinstance(command, commands.CloseConnection):
                command.connection.state = ConnectionState.CLOSED
        return done

    def data(self, data: bytes) -> list[commands.Command]:
        return self.send(events.DataReceived(self.client, data))

    def closed(self) -> list[commands.Command]:
        self.client.state &= ~ConnectionState.CAN_READ
        return self.send(events.ConnectionClosed(self.client))

    def reply(self, hook: commands.StartHook) -> list[commands.Command]:
        return self.send(events.HookCompleted(hook))


def shown(done: list[commands.Command]) -> list[tuple]:
    """Commands as plain values (mitmproxy's commands do not compare): what was sent to the
    client, that it was closed, which hook was asked."""
    plain: list[tuple] = []
    for command in done:
        if isinstance(command, commands.ConnectionCommand):
            assert command.connection.peername == ("10.0.0.2", 40000)  # only ever the client
        if isinstance(command, commands.SendData):
            plain.append(("send", command.data))
        elif isinstance(command, commands.CloseConnection):
            plain.append(("close",))
        else:
            plain.append((type(command).__name__,))
    return plain


CLOSE = [("close",)]


def sent(done: list[commands.Command]) -> bytes:
    return b"".join(c.data for c in done if isinstance(c, commands.SendData))


def closes(done: list[commands.Command]) -> bool:
    return any(isinstance(c, commands.CloseConnection) for c in done)


def connect_head(target: str = "good.test:443") -> bytes:
    return (
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        "Proxy-Authorization: Basic YWNtZS5idWlsZGVyOnQ=\r\n\r\n"
    ).encode()


def connect_layer(gate: FakeGate) -> Driver:
    return Driver(lambda context: Connect(context, _typed(gate)))


class TestConnect:
    def test_an_allowed_connect_is_answered_200_and_admitted_once(self):
        gate = FakeGate()
        driver = connect_layer(gate)
        done = driver.data(connect_head())
        assert shown(done) == [("send", CONNECTED)]
        (attempt,) = gate.asked
        assert (attempt.host, attempt.port) == ("good.test", 443)
        assert attempt.credential == "Basic YWNtZS5idWlsZGVyOnQ="
        assert gate.heads == [driver.client.id] and len(gate.admitted) == 1

    def test_a_head_that_comes_in_pieces_is_decided_once_it_is_whole(self):
        gate = FakeGate()
        driver = connect_layer(gate)
        head = connect_head()
        assert driver.data(head[:20]) == [] and driver.data(head[20:-1]) == []
        assert gate.asked == []
        assert sent(driver.data(head[-1:])) == CONNECTED

    def test_a_refused_connect_is_answered_with_its_reason_and_closed_unadmitted(self):
        gate = FakeGate(first=allowed().refuse(Code.NOT_ON_ALLOWLIST))
        driver = connect_layer(gate)
        done = driver.data(connect_head() + HELLO)
        answer = sent(done)
        assert answer.startswith(b"HTTP/1.1 403 ")
        assert b"X-Covey-Deny-Reason: not-on-allowlist\r\n" in answer
        assert b"Connection: close\r\n" in answer
        assert closes(done) and gate.admitted == [] and gate.hellos == []
        assert driver.data(b"more") == []  # nothing more is read or answered

    def test_a_connect_that_must_wait_asks_the_hook_and_answers_nothing_before(self):
        gate = FakeGate(first=LookUp("token-hash", "10.0.0.2"))
        driver = connect_layer(gate)
        (hook,) = driver.data(connect_head())
        assert isinstance(hook, CoveyDecideHook) and hook.blocking
        assert hook.request.pending == gate.first and gate.admitted == []
        assert driver.data(HELLO) == []  # bytes sent ahead wait for the decision
        hook.request.decision = allowed()
        done = driver.reply(hook)
        assert sent(done) == CONNECTED and len(gate.admitted) == 1
        assert gate.hellos == [HELLO]  # what came meanwhile is checked next

    def test_a_hook_that_decides_nothing_refuses_the_connect(self):
        gate = FakeGate(first=allowed(address=None))  # allowed by name: the name to resolve
        driver = connect_layer(gate)
        (hook,) = driver.data(connect_head())
        done = driver.reply(hook)
        assert sent(done).startswith(b"HTTP/1.1 403 ") and b"bad-request" in sent(done)
        assert closes(done) and gate.admitted == []

    def test_a_hook_that_refuses_is_answered_with_its_refusal(self):
        gate = FakeGate(first=allowed(address=None))
        driver = connect_layer(gate)
        (hook,) = driver.data(connect_head())
        hook.request.decision = allowed().refuse(Code.NON_PUBLIC_ADDRESS)
        done = driver.reply(hook)
        assert b"X-Covey-Deny-Reason: non-public-address" in sent(done)
        assert closes(done) and gate.admitted == []

    @pytest.mark.parametrize(
        ("opening", "why"),
        [
            (b"GET http://good.test/ HTTP/1.1\r\nHost: good.test\r\n\r\n", b"only CONNECT"),
            (b"CONNECT  HTTP/1.1\r\n\r\n", b"bad request"),
            (b"CONNECT " + b"a" * MAX_HEAD, b"too large"),
        ],
    )
    def test_anything_but_a_connect_head_is_answered_400_and_closed(self, opening, why):
        gate = FakeGate()
        driver = connect_layer(gate)
        done = driver.data(opening)
        assert sent(done).startswith(b"HTTP/1.1 400 ") and why in sent(done)
        assert closes(done) and gate.asked == [] and gate.admitted == []

    def test_the_tunnel_goes_on_only_after_its_client_hello_passes(self):
        gate = FakeGate()
        driver = connect_layer(gate)
        driver.data(connect_head())
        assert driver.data(HELLO[:5]) == []  # not whole yet: wait, send nothing
        assert gate.handed == []
        assert driver.data(HELLO[5:] + b" and more") == []
        assert gate.hellos == [HELLO[:5], HELLO + b" and more"]
        (client_id, tunnel, early) = gate.handed[0]
        assert (client_id, tunnel) == (driver.client.id, gate.admitted[0])
        assert early() == HELLO + b" and more"  # every byte, once, for the upstream
        assert early() == b""
        assert isinstance(driver.layer, Connect) and isinstance(driver.layer.child, Passthrough)

    def test_a_client_hello_sent_with_the_connect_is_checked_at_once(self):
        gate = FakeGate()
        driver = connect_layer(gate)
        assert sent(driver.data(connect_head() + HELLO)) == CONNECTED
        assert gate.hellos == [HELLO] and len(gate.handed) == 1

    def test_a_tunnel_whose_first_bytes_are_refused_is_closed_and_never_handed_over(self):
        gate = FakeGate(hello=lambda data: False)
        driver = connect_layer(gate)
        driver.data(connect_head())
        done = driver.data(b"GET / HTTP/1.1\r\n\r\n")
        assert shown(done) == CLOSE
        assert gate.handed == [] and driver.data(HELLO) == []

    def test_a_client_that_goes_before_its_hello_closes_the_tunnel(self):
        gate = FakeGate()
        driver = connect_layer(gate)
        driver.data(connect_head())
        done = driver.closed()
        assert shown(done) == CLOSE
        assert gate.handed == [] and driver.data(HELLO) == []


def passthrough(gate: FakeGate) -> tuple[Driver, Tunnel]:
    tunnel = Tunnel("d1", Attempt(None, "good.test", 443), allowed())
    return Driver(lambda context: Passthrough(context, _typed(gate), tunnel)), tunnel


class TestPassthrough:
    def test_the_first_bytes_start_one_hand_over_and_the_rest_are_collected_for_it(self):
        gate = FakeGate()
        driver, tunnel = passthrough(gate)
        assert driver.data(HELLO) == [] and driver.data(b"more") == []
        ((client_id, handed, early),) = gate.handed  # one hand-over, whatever comes after
        assert (client_id, handed) == (driver.client.id, tunnel)
        assert early() == HELLO + b"more" and early() == b""
        assert driver.data(b"again") == [] and early() == b"again"
        assert tunnel.bytes_up == len(HELLO + b"more" + b"again")

    def test_a_closed_client_closes_the_tunnel_and_the_hand_over_stops(self):
        gate = FakeGate()
        driver, _ = passthrough(gate)
        driver.data(HELLO)
        ((_, _, early),) = gate.handed
        assert shown(driver.closed()) == CLOSE
        assert early() is None  # the hand-over ends there
        assert driver.data(b"late") == []

    def test_bytes_that_reach_it_after_the_relay_took_over_close_the_connection(self):
        gate = FakeGate()
        driver, tunnel = passthrough(gate)
        driver.data(HELLO)
        tunnel.relay = object()  # the relay owns the socket now
        tunnel.discard = lambda: None  # no real relay to close
        assert shown(driver.data(b"overtaking")) == CLOSE
        assert gate.handed[0][2]() is None
