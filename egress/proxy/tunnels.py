"""Allowed tunnels, and the hand-over of one that mitmproxy carried (a CONNECT sent after a
plain request on one connection) to covey's :class:`Relay`; the front door carries all others.

What covey touches of mitmproxy beyond its addon and layer API is here and only here: the
connection handlers of its ``proxyserver`` addon, their transports and stream buffers, and
cancelling a handler to close a client (the layers use mitmproxy's layer API and the plain-HTTP
layer its HTTP/1 server's buffer; the front door its HTTP/1 head helpers and a server instance's
``handle_stream``). A mitmproxy upgrade is checked against this file first.
"""

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from mitmproxy import ctx

import logs
from egress.policy import Attempt, Decision
from egress.proxy.relay import Relay

logger = logging.getLogger(__name__)

HANDOVER_SECONDS = 2.0  # how long a client may take to read its 200 before the relay takes over
CONNECT_SECONDS = 10.0  # how long dialling the upstream may take


@dataclass
class Tunnel:
    """An allowed CONNECT tunnel, from the decision until the client disconnects."""

    decision_id: str
    attempt: Attempt  # aimed at the decided host; decided again by every new policy
    decision: Decision  # the allow, with the vetted address
    started: bool = False  # the ClientHello was checked and the bytes flow
    bytes_up: int = 0  # before the relay took over; then the relay counts
    bytes_down: int = 0
    handover: "asyncio.Task[None] | None" = None  # dials, sends the first bytes, starts the relay
    upstream: socket.socket | None = None  # ours, once dialled (mitmproxy never sees it)
    relay: Relay | None = None

    @property
    def agent_id(self) -> int:
        assert self.decision.agent is not None  # noqa: S101 - an allow has its agent
        return self.decision.agent.id

    @property
    def address(self) -> str:
        assert self.decision.address is not None  # noqa: S101 - and its address
        return self.decision.address

    def discard(self) -> None:
        """Stop the hand-over and the relay and close the upstream, whatever state they are in."""
        if self.handover is not None:
            self.handover.cancel()  # a no-op once it is done
        if self.relay is not None:
            self.relay.close()
        if self.upstream is not None:
            self.upstream.close()

    def totals(self) -> tuple[int, int]:
        """Bytes up and down so far."""
        if self.relay is None:
            return self.bytes_up, self.bytes_down
        return self.bytes_up + self.relay.up.bytes, self.bytes_down + self.relay.down.bytes


@dataclass
class ClientState:
    """What the proxy knows about one client connection."""

    tunnel: Tunnel | None = None
    # plain HTTP: (host, port) as mitmproxy will dial it → the vetted address
    pinned: dict[tuple[str, int], str] = field(default_factory=dict)
    # plain HTTP upgraded (101, a WebSocket): the allowed attempt, checked again as a tunnel's,
    # and its agent's id
    upgraded: tuple[Attempt, int] | None = None


def close_client(client_id: str, tunnel: Tunnel | None) -> int:
    """Close a client connection (and its relay at once: the handler's teardown takes a few
    steps); 1 if there was one to close."""
    if tunnel is not None and tunnel.relay is not None:
        tunnel.relay.close()
    handler = _handler(client_id)
    io = handler.transports.get(handler.client) if handler else None
    if io is None or io.handler is None:
        return 0
    io.handler.cancel()  # mitmproxy then closes both sides and reports the disconnect
    return 1


async def hand_over(
    client_id: str, tunnel: Tunnel, early: Callable[[], bytes | None], close: Callable[[str], Any]
) -> None:
    """:func:`_hand_over`, its lines carrying the agent's id (this task's own)."""
    agent = tunnel.decision.agent
    with logs.bound(agent_id=agent.id if agent is not None else None):
        await _hand_over(client_id, tunnel, early, close)


async def _hand_over(
    client_id: str, tunnel: Tunnel, early: Callable[[], bytes | None], close: Callable[[str], Any]
) -> None:
    """Dial the vetted address, send the client's first bytes, then give both sockets to a
    :class:`Relay`; ``close(client_id)`` ends the connection when that fails or the relay ends.
    ``early()`` gives the client's bytes mitmproxy read since it was last asked (the
    :class:`~egress.proxy.layers.Passthrough` collects them), None once the tunnel is closed.
    Cancelled (by :meth:`Tunnel.discard`) when the client goes first.

    The client stops being read; once every byte mitmproxy read from it has been sent upstream
    and everything written to it (the 200) has left, the relay takes over. A client that does
    not read its 200 within HANDOVER_SECONDS is closed.
    """
    await asyncio.sleep(0)  # out of mitmproxy's event handling first
    handler = _handler(client_id)
    streams = _streams(handler)
    if streams is None:
        close(client_id)
        return
    reader, writer = streams
    transport = cast(asyncio.Transport, writer.transport)
    # A client may send faster than any upstream answers a dial: what mitmproxy read meanwhile
    # would pile up in memory, so the rest waits in the client's socket.
    _pause(reader, writer)
    try:
        tunnel.upstream = await _dial(tunnel.address, tunnel.decision.port)
    except (OSError, TimeoutError) as exc:
        logger.info("covey: could not reach %s:%s: %s", tunnel.address, tunnel.decision.port, exc)
        close(client_id)
        return
    upstream = tunnel.upstream
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANDOVER_SECONDS
    try:
        while True:
            _pause(reader, writer)
            data = early()
            if data is None:
                return  # closed meanwhile
            if data:
                await loop.sock_sendall(upstream, data)
                continue
            if _quiet(reader, writer):
                break
            if loop.time() >= deadline:
                logger.info("covey: tunnel %s did not go quiet; closing", client_id)
                close(client_id)
                return
            await asyncio.sleep(0.001)
    except OSError as exc:
        logger.info("covey: tunnel to %s:%s failed: %s", tunnel.address, tunnel.decision.port, exc)
        close(client_id)
        return

    def ended(error: OSError | None) -> None:
        if error is not None:
            logger.debug("covey: tunnel %s ended: %s", client_id, error)
        close(client_id)

    tunnel.relay = Relay(
        transport.get_extra_info("socket"),
        upstream,
        on_activity=handler.timeout_watchdog.register_activity,
        on_end=ended,
    )
    tunnel.relay.start()


def pause_reading(client_id: str) -> Callable[[], None]:
    """Read nothing more from a client while its connection waits (on a decision): mitmproxy
    queues what arrives meanwhile for the waiting layer, without bound. Returns what resumes
    it; a connection that is to be closed is not resumed (a read waiting on mitmproxy when it
    closes the connection would leave the socket open)."""
    streams = _streams(_handler(client_id))
    if streams is None:
        return lambda: None
    reader, writer = streams
    _pause(reader, writer)

    def resume() -> None:
        if not writer.transport.is_closing():
            cast(asyncio.Transport, writer.transport).resume_reading()

    return resume


def answer_now(client_id: str, data: bytes) -> bool:
    """Write ``data`` to a client at once, ahead of mitmproxy's layers, and close the
    connection once it has left; False when the client has gone."""
    streams = _streams(_handler(client_id))
    if streams is None:
        return False
    streams[1].write(data)
    streams[1].close()
    return True


def _streams(handler: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A client connection's reader and writer (None once it has gone)."""
    io = handler.transports.get(handler.client) if handler else None
    if io is None or not (
        isinstance(io.writer, asyncio.StreamWriter) and isinstance(io.reader, asyncio.StreamReader)
    ):
        return None
    return io.reader, io.writer


def _pause(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Stop reading a client until covey resumes it (the reader's own flow control, which
    resumes a transport it paused once its buffer drains, no longer owns the pause)."""
    cast(asyncio.Transport, writer.transport).pause_reading()
    reader._paused = False  # type: ignore[attr-defined]


async def _dial(address: str, port: int) -> socket.socket:
    """A TCP connection to the vetted address, ours alone (mitmproxy never sees it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async with asyncio.timeout(CONNECT_SECONDS):
            await asyncio.get_running_loop().sock_connect(sock, (address, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _handler(client_id: str) -> Any:
    """mitmproxy's handler of one client connection (None once it has gone)."""
    proxyserver = ctx.master.addons.get("proxyserver")
    return proxyserver.connections.get(client_id) if proxyserver else None


def _quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Nothing read and not yet forwarded, nothing forwarded and not yet written, no EOF."""
    transport = writer.transport
    return (
        not transport.is_reading()  # type: ignore[attr-defined]
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
        and not reader._buffer  # type: ignore[attr-defined]  # no public way to ask
        and not reader.at_eof()
        and reader.exception() is None
    )
