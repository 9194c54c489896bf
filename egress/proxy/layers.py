"""The protocol layers covey gives mitmproxy, and which one a connection gets.

mitmproxy sees only the connections covey's front door (:mod:`egress.proxy.front`) hands it:
those that do not open with CONNECT. They get mitmproxy's HTTP layer, bounded
(:class:`PlainHttp`), whose requests the addon decides in its hooks. A CONNECT later on such a
connection is decided in the addon's ``http_connect``; once its first bytes are a TLS
ClientHello whose SNI is the CONNECT host, a :class:`Passthrough` collects them until the
hand-over (:mod:`egress.proxy.tunnels`) gives the sockets to a relay (:func:`choose_layer`).

What the layers need of the addon is the :class:`Gate` (the addon is one; the tests use a small
fake, tests/egress/test_layers.py).
"""

import logging
from collections.abc import Callable
from typing import Protocol

from mitmproxy import connection
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import Http1Server, HTTPMode

from egress.proxy.answers import answer
from egress.proxy.tunnels import Tunnel

logger = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # a request's head (and what a plain-HTTP client may send ahead)


class Gate(Protocol):
    """What the layers ask of the addon (:class:`~egress.proxy.addon.CoveyEgress`): step 5 and
    the state it keeps per client connection."""

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
    """Which layer handles a connection's new bytes: mitmproxy's HTTP layer for a new one (the
    front door keeps those that open with CONNECT); after a CONNECT that the HTTP layer let
    through, a :class:`Passthrough` once the ClientHello is checked; anything else is refused
    (fail closed: no decision, no bytes)."""
    if nextlayer.layer is not None:
        return
    context = nextlayer.context
    if len(context.layers) == 1:  # a new client connection
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


def peer(client: connection.Client) -> str:
    """The address a client connection came from (what look-ups are counted by)."""
    address = client.peername
    return str(address[0]) if address else ""
