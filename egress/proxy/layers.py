"""The protocol layers covey gives mitmproxy, and which one a connection gets.

A connection that opens with CONNECT (nearly all of them) is answered by covey's own
:class:`Connect` layer: it reads the head, asks for the decision (at once when the name's
addresses are cached, else through one hook while the resolver waits), answers 200 or the
refusal, and lets the tunnel go on only once its first bytes are a TLS ClientHello whose SNI is
the CONNECT host; then a :class:`Passthrough` collects the first bytes until the hand-over
(:mod:`egress.proxy.tunnels`) gives the sockets to a relay. A connection that opens with a plain
HTTP request gets mitmproxy's HTTP layer, whose requests the addon decides in its hooks; a
CONNECT on such a connection is checked here too (:func:`choose_layer`).

What the layers need of the addon is the :class:`Gate` (the addon is one; the tests use a small
fake, tests/egress/test_layers.py).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mitmproxy import connection, http
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import Http1Server, HTTPMode

from egress.policy import Attempt, Code, Decision
from egress.proxy.answers import refusal
from egress.proxy.lookups import LookUp
from egress.proxy.tunnels import Tunnel

logger = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # a request's head (and what a plain-HTTP client may send ahead)
CONNECTED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class Gate(Protocol):
    """What the layers ask of the addon (:class:`~egress.proxy.addon.CoveyEgress`): the
    decision and the state it keeps per client connection."""

    def head_came(self, client_id: str) -> None:
        """A request head was read whole: the connection no longer waits for one."""

    def decide_now(self, attempt: Attempt, client: str) -> Decision | LookUp:
        """The decision as far as it goes without waiting: a refusal, an allow with its
        address, an allow by name whose name must be resolved, or a token to look up (the
        latter two through the ``covey_decide`` hook)."""
        ...

    def admit(self, client_id: str, attempt: Attempt, decision: Decision) -> Tunnel | None:
        """Log an allow and remember it for the connection: its tunnel, for a CONNECT."""
        ...

    def check_hello(self, tunnel: Tunnel, data: bytes) -> bool | None:
        """Step 5 on the tunnel's first bytes: True to let them flow, False when refused, None
        to wait for more."""
        ...

    def tunnel_of(self, client_id: str) -> Tunnel | None:
        """The connection's allowed tunnel, if it has one."""
        ...

    def hand_over(self, client_id: str, tunnel: Tunnel, early: Callable[[], bytes | None]) -> None:
        """Start handing the tunnel to a relay; ``early()`` gives the client's bytes read since
        it was last asked, None once the tunnel is closed."""


@dataclass
class ConnectRequest:
    """A CONNECT that must wait: its name resolved (``pending`` is its allow by name), or its
    token looked up first; and, once decided, its decision."""

    attempt: Attempt
    pending: Decision | LookUp
    client_id: str  # the connection's: nothing more is read from it while it waits
    decision: Decision | None = None


@dataclass
class CoveyDecideHook(commands.StartHook):
    """The Connect layer asks the addon (``covey_decide``) to decide a CONNECT."""

    request: ConnectRequest


class Connect(layer.Layer):
    """A client connection that opens with CONNECT, answered by covey itself.

    mitmproxy's HTTP layer would parse the request, run several hooks, build a flow and a
    response, then ask for the next layer again when the tunnel's first bytes come; this layer
    reads the CONNECT head, asks for the decision (one hook, since resolving may wait), answers,
    checks the ClientHello and hands the tunnel to a :class:`Passthrough`. A refused CONNECT
    closes the connection.
    """

    def __init__(self, context: Context, egress: Gate) -> None:
        super().__init__(context)
        self.egress = egress
        self.buffer = b""
        self.tunnel: Tunnel | None = None
        self.child: Passthrough | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.child is not None:
            yield from self.child.handle_event(event)
        elif isinstance(event, events.DataReceived) and event.connection == self.context.client:
            self.buffer += event.data
            if self.tunnel is None:
                yield from self._read_connect()
            else:
                yield from self._read_hello()
        elif isinstance(event, events.ConnectionClosed):
            yield from self._close()

    def _read_connect(self) -> layer.CommandGenerator[None]:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                yield from self._answer(400, "the request head is too large")
            return
        head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
        self.egress.head_came(self.context.client.id)
        try:
            request = http1.read_request_head(head.split(b"\r\n"))
        except ValueError as exc:
            yield from self._answer(400, f"bad request: {exc}")
            return
        if request.method != "CONNECT" or not request.host:
            yield from self._answer(400, "only CONNECT host:port may open this connection")
            return
        attempt = Attempt(request.headers.get("Proxy-Authorization"), request.host, request.port)
        first = self.egress.decide_now(attempt, peer(self.context.client))
        decision: Decision | None
        if isinstance(first, Decision) and (not first.allowed or first.address is not None):
            decision = first  # refused, or allowed with its addresses checked
        else:  # it must wait (a name to resolve, a token to look up): a hook, the loop goes on
            asked = ConnectRequest(attempt, first, self.context.client.id)
            yield CoveyDecideHook(asked)
            decision = asked.decision
        if decision is None or not decision.allowed:
            response = refusal(decision or Decision(Code.BAD_REQUEST, request.host, request.port))
            response.headers["Connection"] = "close"
            yield commands.SendData(self.context.client, http1.assemble_response(response))
            yield from self._close()
            return
        self.tunnel = self.egress.admit(self.context.client.id, attempt, decision)
        yield commands.SendData(self.context.client, CONNECTED)
        if self.buffer:
            yield from self._read_hello()

    def _read_hello(self) -> layer.CommandGenerator[None]:
        tunnel = self.tunnel
        assert tunnel is not None  # noqa: S101 - only called once there is one
        checked = self.egress.check_hello(tunnel, self.buffer)
        if checked is None:
            return  # wait for the rest of the ClientHello
        if not checked:
            yield from self._close()
            return
        self.child = Passthrough(self.context, self.egress, tunnel)
        data, self.buffer = self.buffer, b""
        yield from self.child.handle_event(events.Start())
        yield from self.child.handle_event(events.DataReceived(self.context.client, data))

    def _answer(self, status: int, reason: str) -> layer.CommandGenerator[None]:
        yield commands.SendData(self.context.client, answer(status, reason))
        yield from self._close()

    def _close(self) -> layer.CommandGenerator[None]:
        self._handle_event = self._done  # type: ignore[method-assign]
        if self.tunnel is not None:
            self.tunnel.discard()
        if self.context.client.state is not ConnectionState.CLOSED:
            yield commands.CloseConnection(self.context.client)

    def _done(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


class PlainHttp(layers.HttpLayer):
    """mitmproxy's HTTP layer for a connection that opens with a plain proxy request, with a
    bound on the client's bytes its HTTP/1 server holds unparsed: a request head (which it
    would buffer without end) or what is sent ahead while a request is answered. It reads that
    server's buffer and state, which a mitmproxy upgrade must check."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super()._handle_event(event)
        client = self.context.client
        if not isinstance(event, events.DataReceived) or event.connection != client:
            return
        server = self.connections.get(client)
        if not isinstance(server, Http1Server) or len(server.buf) <= MAX_HEAD:
            return
        if server.state == server.read_headers:
            yield commands.SendData(client, answer(400, "the request head is too large"))
        elif server.state != server.wait:
            return  # a body, passed on as it comes
        server.state = server.done
        yield commands.CloseConnection(client)


class Refuse(layer.Layer):
    """A layer that closes the client connection at once (a tunnel we will not carry)."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start | events.DataReceived):
            yield commands.CloseConnection(self.context.client)
        self._handle_event = self._ignore  # type: ignore[method-assign]

    def _ignore(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


class Passthrough(layer.Layer):
    """A decided tunnel whose ClientHello was checked. The client's bytes are collected here
    until :func:`~egress.proxy.tunnels.hand_over` has sent them upstream and handed both sockets
    to a relay; after that mitmproxy no longer reads the client."""

    def __init__(self, context: Context, egress: Gate, tunnel: Tunnel) -> None:
        super().__init__(context)
        self.egress = egress
        self.tunnel = tunnel
        self.early: list[bytes] = []  # from the client, not yet sent upstream
        self.handing_over = False

    @property
    def forwarding(self) -> bool:
        """The tunnel is open and its bytes flow."""
        return self._handle_event == self._forward

    def take_early(self) -> bytes | None:
        """The client's bytes collected since the last call; None once the tunnel is closed."""
        if not self.forwarding:
            return None
        data, self.early = b"".join(self.early), []
        return data

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            self._handle_event = self._forward  # type: ignore[method-assign]
        yield from ()

    def _forward(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived) and event.connection == self.context.client:
            if self.tunnel.relay is not None:
                # The relay owns the socket: bytes here would overtake or trail its own.
                logger.error("covey: bytes reached mitmproxy after the relay took over; closing")
                yield from self._close()
                return
            self.early.append(event.data)
            self.tunnel.bytes_up += len(event.data)
            if not self.handing_over:
                self.handing_over = True
                self.egress.hand_over(self.context.client.id, self.tunnel, self.take_early)
        elif isinstance(event, events.ConnectionClosed):
            # The client went (or mitmproxy is tearing the tunnel down): TLS has no use for a
            # half-open tunnel before the relay, and the relay passes half-closes on itself.
            yield from self._close()

    def _close(self) -> layer.CommandGenerator[None]:
        self.tunnel.discard()
        self._handle_event = self._done  # type: ignore[method-assign]
        if self.context.client.state is not ConnectionState.CLOSED:
            yield commands.CloseConnection(self.context.client)

    def _done(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


def choose_layer(egress: Gate, nextlayer: layer.NextLayer) -> None:
    """Which layer handles a connection's new bytes: :class:`Connect` for one that opens with
    CONNECT, mitmproxy's HTTP layer for a plain proxy request; after a CONNECT that the HTTP
    layer let through, a :class:`Passthrough` once the ClientHello is checked; anything else is
    refused (fail closed: no decision, no bytes)."""
    if nextlayer.layer is not None:
        return
    context = nextlayer.context
    if len(context.layers) == 1:  # a new client connection
        opening = nextlayer.data_client()
        if opening.startswith(b"CONNECT "):
            nextlayer.layer = Connect(context, egress)
        elif len(opening) < len(b"CONNECT ") and b"CONNECT ".startswith(opening):
            return  # wait for the request line
        else:  # a plain-HTTP proxy request (and whatever follows on the connection)
            nextlayer.layer = PlainHttp(context, HTTPMode.regular)
        return
    tunnel = egress.tunnel_of(context.client.id)
    if tunnel is None or tunnel.started:
        nextlayer.layer = Refuse(context)
        return
    checked = egress.check_hello(tunnel, nextlayer.data_client())
    if checked is None:
        return  # wait for the rest of the ClientHello
    nextlayer.layer = Passthrough(context, egress, tunnel) if checked else Refuse(context)


def answer(status: int, reason: str) -> bytes:
    """A short plain-text answer after which the proxy closes the connection."""
    response = http.Response.make(
        status, reason + "\n", {"Content-Type": "text/plain", "Connection": "close"}
    )
    return http1.assemble_response(response)


def peer(client: connection.Client) -> str:
    """The address a client connection came from (what look-ups are counted by)."""
    address = client.peername
    return str(address[0]) if address else ""
