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

from mitmproxy import connection, options
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context

from egress.policy import AgentPolicy, Attempt, Code, Decision
from egress.proxy.layers import Gate, Passthrough
from egress.proxy.tunnels import Tunnel

AGENT = AgentPolicy(7, "acme.builder", "acme", True, False, ())
HELLO = b"\x16\x03\x01 a ClientHello naming good.test"


def allowed(host: str = "good.test", port: int = 443, address: str | None = "203.0.113.9"):
    return Decision(Code.ALLOWED, host, port, "acme.builder", agent=AGENT, address=address)


@dataclass
class FakeGate:
    """A :class:`Gate` that answers as told and remembers what the layers asked."""

    hello: Callable[[bytes], bool | None] = lambda data: (
        True if data.startswith(HELLO) else None if HELLO.startswith(data) else False
    )
    hellos: list[bytes] = field(default_factory=list)
    handed: list[tuple[str, Tunnel, Callable[[], bytes | None]]] = field(default_factory=list)

    def check_hello(self, tunnel: Tunnel, data: bytes) -> bool | None:
        self.hellos.append(data)
        checked = self.hello(data)
        tunnel.started = bool(checked)
        return checked

    def tunnel_of(self, client_id: str) -> Tunnel | None:
        return None

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
