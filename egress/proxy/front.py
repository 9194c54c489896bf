"""covey's front door: every client connection is accepted here, and no tunnel passes through
mitmproxy.

A connection that opens with CONNECT (nearly all of them) is carried by a :class:`Door` from its
first byte to its last, on the event loop's callbacks: the door reads the head, asks for the
decision (at once when the name's addresses are cached; else in a task, while the resolver or a
token's look-up waits), answers the refusal or 200, and then dials the vetted address at once,
while the ClientHello is still on its way. Once the ClientHello names the CONNECT host (step 5)
and the upstream has answered the dial, the ClientHello goes upstream and a
:class:`~egress.proxy.relay.Relay` moves the rest. Nothing is read from the client while a
decision is awaited, nor past its ClientHello before the relay: what it sends meanwhile waits in
its socket. The head and the ClientHello must both come within COVEY_EGRESS_HEAD_TIMEOUT; a
refused tunnel's dial has carried no byte. A failure inside a door closes it (and is logged).

A connection that opens with anything else (a plain HTTP proxy request, or something that is
not HTTP) is handed, with what was read of it, to mitmproxy's HTTP layer, which the addon
decides in its hooks (:mod:`egress.proxy.addon`).

What a door asks of the addon is a :class:`Gate`; the tests drive doors over real loopback
sockets with a small fake one (tests/egress/test_front.py).
"""

import asyncio
import errno
import functools
import itertools
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Concatenate, Protocol

from mitmproxy.net.http import http1, url
from mitmproxy.net.http.http1.read import raise_if_http_version_unknown

import logs
from egress.policy import Attempt, Code, Decision
from egress.proxy.answers import answer, refusal
from egress.proxy.lookups import LookUp
from egress.proxy.relay import Relay
from egress.proxy.tunnels import CONNECT_SECONDS, Tunnel

logger = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # a request's head, with what a client sends ahead of the answer
CONNECT = b"CONNECT "
CONNECTED = b"HTTP/1.1 200 Connection established\r\n\r\n"
BACKLOG = 1024  # connections the kernel holds for accepting (a burst of sandboxes starting)
ACCEPTS_PER_WAKE = 64  # at most this many accepted per wake-up, so the rest of the loop goes on
ACCEPT_PAUSE_SECONDS = 1.0  # out of file descriptors: accept again after this long
IDLE_CHECK_SECONDS = 5.0
READ_SIZE = 64 * 1024

PlainHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Gate(Protocol):
    """What a door asks of the addon (:class:`~egress.proxy.addon.CoveyEgress`): the decision,
    and the state the addon keeps per client connection."""

    def opened(self, client_id: str) -> None:
        """A client connected: its request head is awaited from now."""

    def head_came(self, client_id: str) -> None:
        """A request head was read whole: the connection no longer waits for one."""

    def decide_now(self, attempt: Attempt, client: str) -> Decision | LookUp:
        """The decision as far as it goes without waiting: a refusal, an allow with its
        address, an allow by name whose name must be resolved, or a token to look up."""
        ...

    async def settle(self, attempt: Attempt, pending: Decision | LookUp) -> Decision:
        """The decision :meth:`decide_now` could not give at once."""
        ...

    def admit(self, client_id: str, attempt: Attempt, decision: Decision) -> Tunnel | None:
        """Log an allow and remember it for the connection: its tunnel, for a CONNECT."""
        ...

    def check_hello(self, tunnel: Tunnel, data: bytes) -> bool | None:
        """Step 5 on the tunnel's first bytes: True to let them flow, False when refused, None
        to wait for more."""
        ...

    def closed(self, client_id: str) -> None:
        """A client connection ended (its tunnel's close is logged)."""


class Front:
    """Listens for clients and gives each a :class:`Door`; ``plain`` takes a connection that
    does not open with CONNECT (mitmproxy's handling of a client stream)."""

    def __init__(self, gate: Gate, plain: PlainHandler, *, idle_seconds: float = 600.0) -> None:
        self.gate = gate
        self.plain = plain
        self.idle_seconds = idle_seconds  # a tunnel moving no bytes this long is closed
        self.doors: dict[str, Door] = {}
        self.listeners: list[socket.socket] = []
        self._accepting = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)

    def bind(self, host: str, port: int) -> None:
        """Bind every address ``host`` names, so that one in use fails now (OSError); clients
        are refused until :meth:`start` listens."""
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )
        try:
            for family, kind, proto, _, address in dict.fromkeys(
                (info[0], info[1], info[2], "", info[4]) for info in infos
            ):
                listener = socket.socket(family, kind, proto)
                self.listeners.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(self.listeners) > 1:  # the same free port on each address
                    address = (address[0], self.listeners[0].getsockname()[1], *address[2:])
                listener.bind(address)
                listener.setblocking(False)
        except OSError:
            self.close_listeners()
            raise

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [listener.getsockname()[:2] for listener in self.listeners]

    def start(self) -> None:
        """Listen and accept clients, and close tunnels idle for ``idle_seconds``; OSError
        when a port bound meanwhile by another process is listened on first."""
        for listener in self.listeners:
            listener.listen(BACKLOG)
        self._accept_again()
        self._spawn(self._watch_idle())

    def stop(self) -> None:
        """Accept no more and close every door (their tunnels' ends are logged)."""
        self._stop_accepting()
        self.close_listeners()
        for door in list(self.doors.values()):
            door.close()
        for task in list(self._tasks):
            task.cancel()

    def close_listeners(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.listeners = []

    def close(self, client_id: str) -> bool:
        """Close a client connection of this front; False if it has none of that id."""
        door = self.doors.get(client_id)
        if door is None:
            return False
        door.close()
        return True

    def next_id(self) -> str:
        return f"covey-{next(self._ids)}"  # mitmproxy's connection ids are UUIDs: never the same

    def _spawn(self, work: Awaitable[None]) -> "asyncio.Task[None]":
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _accept_again(self) -> None:
        loop = asyncio.get_running_loop()
        for listener in self.listeners:
            loop.add_reader(listener.fileno(), self._accept, listener)
        self._accepting = True

    def _stop_accepting(self) -> None:
        if not self._accepting:
            return
        loop = asyncio.get_running_loop()
        for listener in self.listeners:
            loop.remove_reader(listener.fileno())
        self._accepting = False

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logger.warning("covey: accepting a client failed: %s", exc)
                    return
                # Out of files: the waiting clients stay in the backlog until some close.
                logger.warning(
                    "covey: cannot accept clients (%s); trying again in %g s",
                    exc,
                    ACCEPT_PAUSE_SECONDS,
                )
                self._stop_accepting()
                asyncio.get_running_loop().call_later(ACCEPT_PAUSE_SECONDS, self._accept_again)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            Door(self, sock, str(address[0]))

    async def _watch_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(IDLE_CHECK_SECONDS)
            quiet_since = loop.time() - self.idle_seconds
            for door in [door for door in self.doors.values() if door.active < quiet_since]:
                door.close()

    def hand_to_plain(self, sock: socket.socket, read: bytes) -> None:
        """Give a client connection, of which ``read`` was read, to ``plain`` as a stream."""
        task = self._spawn(self._to_plain(sock, read))
        # Cancelled before it ran (the proxy stopping): the socket is still the front's.
        task.add_done_callback(lambda done: sock.close() if done.cancelled() else None)

    async def _to_plain(self, sock: socket.socket, read: bytes) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        reader.feed_data(read)  # ahead of all the transport reads from now
        protocol = asyncio.StreamReaderProtocol(reader, self.plain, loop=loop)
        try:
            await loop.connect_accepted_socket(lambda: protocol, sock)
        except OSError as exc:
            logger.info("covey: a plain client went before it was served: %s", exc)
            sock.close()


def read_connect(head: bytes) -> tuple[str, int, str | None]:
    """The host, port and Proxy-Authorization of a CONNECT request's head (without the blank
    line that ends it), read as mitmproxy's HTTP/1 parser reads it: its checks of the request
    line, the authority and the version, and its rules for header lines (a repeated header's
    values joined by ", "), without building a whole request; a target it reads as no host (an
    origin form, ``*``), where no tunnel can go, is refused. ValueError says what is wrong."""
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].split()
        if method != b"CONNECT":
            raise ValueError("not a CONNECT")
        host, port = url.parse_authority(target, check=True)
        if not host or not port:
            raise ValueError("no host:port")
        raise_if_http_version_unknown(version)
    except ValueError as exc:
        raise ValueError(f"Bad HTTP request line: {lines[0]!r}") from exc
    credentials: list[bytes] = []
    last: bytes | None = None  # the name of the header a continuation line continues
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            if last is None:
                raise ValueError("Invalid headers")
            if last == b"proxy-authorization":
                credentials[-1] += b"\r\n " + line.strip()
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name:
            raise ValueError(f"Invalid header line: {line!r}")
        last = name.lower()
        if last == b"proxy-authorization":
            credentials.append(value.strip())
    credential = b", ".join(credentials).decode("utf-8", "surrogateescape") if credentials else None
    return host, port, credential


def _closing_on_error[**P](
    callback: Callable[Concatenate["Door", P], None],
) -> Callable[Concatenate["Door", P], None]:
    """A door's step (a loop callback, or what a task goes on with) that closes the door when
    it fails, instead of letting the error reach the event loop and leaving the connection half
    open."""

    @functools.wraps(callback)
    def guarded(door: "Door", *args: P.args, **kwargs: P.kwargs) -> None:
        try:
            callback(door, *args, **kwargs)
        except Exception:
            logger.exception("covey: a tunnel failed; closing it")
            door.close()

    return guarded


class Door:
    """One client connection that opened with CONNECT, from its head to its end."""

    def __init__(self, front: Front, sock: socket.socket, peer: str) -> None:
        self.front, self.gate, self.sock, self.peer = front, front.gate, sock, peer
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self.id = front.next_id()
        self.buffer = b""  # read from the client and not yet passed on
        self.out = b""  # for the client, not yet taken by its socket
        self.tunnel: Tunnel | None = None
        self.upstream: socket.socket | None = None
        self.connected = False  # the upstream answered the dial
        self.hello_checked = False
        self.closing = False  # close once ``out`` is written
        self.closed = False
        self.reading = self.writing = self.dialling = False
        self.deciding: asyncio.Task[None] | None = None
        self.dial_timer: asyncio.TimerHandle | None = None
        self.active = self.loop.time()
        front.doors[self.id] = self
        self.gate.opened(self.id)
        self._read_on()

    # --- reading the client ------------------------------------------------------------------

    def _read_on(self) -> None:
        if not self.reading and not self.closed:
            self.loop.add_reader(self.fd, self._readable)
            self.reading = True

    def _read_off(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.fd)
            self.reading = False

    @_closing_on_error
    def _readable(self) -> None:
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:  # before the relay, a half-closed client has nothing to wait for
            self.close()
            return
        self.active = self.loop.time()
        self.buffer += data
        if self.tunnel is None:
            self._read_head()
        else:
            self._read_hello()

    def _read_head(self) -> None:
        buffer = self.buffer
        if not buffer.startswith(CONNECT):
            if len(buffer) < len(CONNECT) and CONNECT.startswith(buffer):
                return  # wait for the rest of the method
            self._hand_to_plain()
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                self._answer(400, "the request head is too large")
            return
        head, self.buffer = buffer[:end], buffer[end + 4 :]
        try:
            host, port, credential = read_connect(head)
        except ValueError as exc:
            self._answer(400, f"bad request: {exc}")
            return
        attempt = Attempt(credential, host, port)
        first = self.gate.decide_now(attempt, self.peer)
        if isinstance(first, Decision) and (not first.allowed or first.address is not None):
            self._decided(attempt, first)  # refused, or allowed with its addresses checked
            return
        self._read_off()  # a name to resolve or a token to look up: the loop goes on meanwhile
        self.deciding = self.loop.create_task(self._settle(attempt, first))

    async def _settle(self, attempt: Attempt, pending: Decision | LookUp) -> None:
        decision: Decision | None
        try:
            decision = await self.gate.settle(attempt, pending)
        except Exception:  # refused: a CONNECT nobody decided never goes on
            logger.exception("covey: deciding a CONNECT failed")
            decision = None
        self.deciding = None
        if not self.closed:
            self._decided(attempt, decision)

    @_closing_on_error
    def _decided(self, attempt: Attempt, decision: Decision | None) -> None:
        if decision is None or not decision.allowed:
            response = refusal(decision or Decision(Code.BAD_REQUEST, attempt.host, attempt.port))
            response.headers["Connection"] = "close"
            self._send_and_close(http1.assemble_response(response))
            return
        self.tunnel = self.gate.admit(self.id, attempt, decision)
        assert self.tunnel is not None  # noqa: S101 - a CONNECT's allow is a tunnel
        self._send(CONNECTED)
        self._dial()
        if self.buffer:
            self._read_hello()
        if not self.hello_checked:
            self._read_on()

    def _read_hello(self) -> None:
        assert self.tunnel is not None  # noqa: S101 - only once there is one
        if self.hello_checked or self.closed:
            return
        checked = self.gate.check_hello(self.tunnel, self.buffer)
        if checked is None:
            return  # wait for the rest of the ClientHello
        if not checked:
            self.close()
            return
        self.hello_checked = True
        self._read_off()  # what follows waits in the socket for the relay
        self.gate.head_came(self.id)  # no deadline from here: the relay's idle time only
        self._relay_when_ready()

    # --- the upstream ------------------------------------------------------------------------

    def _dial(self) -> None:
        tunnel = self.tunnel
        if self.closed or tunnel is None:
            return
        address, port = tunnel.address, tunnel.decision.port
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            upstream = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # out of files, say
            self._unreachable(str(exc))
            return
        tunnel.upstream = self.upstream = upstream  # closed with the tunnel from now
        upstream.setblocking(False)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        failed = upstream.connect_ex((address, port))
        if failed == 0:
            self.connected = True
        elif failed in (errno.EINPROGRESS, errno.EAGAIN):
            self.loop.add_writer(upstream.fileno(), self._dialled)
            self.dialling = True
            self.dial_timer = self.loop.call_later(CONNECT_SECONDS, self._dial_timed_out)
        else:
            self._unreachable(os.strerror(failed))

    @_closing_on_error
    def _dialled(self) -> None:
        assert self.upstream is not None  # noqa: S101 - dialling
        self._dial_over()
        failed = self.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if failed:
            self._unreachable(os.strerror(failed))
            return
        self.connected = True
        self._relay_when_ready()

    @_closing_on_error
    def _dial_timed_out(self) -> None:
        self.dial_timer = None
        self._dial_over()
        self._unreachable(f"no answer in {CONNECT_SECONDS:g} s")

    def _dial_over(self) -> None:
        if self.dialling and self.upstream is not None:
            self.loop.remove_writer(self.upstream.fileno())
            self.dialling = False
        if self.dial_timer is not None:
            self.dial_timer.cancel()
            self.dial_timer = None

    def _unreachable(self, why: str) -> None:
        tunnel = self.tunnel
        assert tunnel is not None  # noqa: S101 - only a tunnel dials
        with logs.bound(agent_id=tunnel.agent_id):
            logger.info(
                "covey: could not reach %s:%s: %s", tunnel.address, tunnel.decision.port, why
            )
        self.close()

    def _relay_when_ready(self) -> None:
        """Once the ClientHello is checked, the dial answered and the 200 taken by the client:
        the ClientHello (and anything after it) goes upstream first, then the relay moves the
        rest."""
        tunnel = self.tunnel
        if not (self.hello_checked and self.connected) or self.out or self.closed:
            return
        assert tunnel is not None and self.upstream is not None  # noqa: S101 - connected
        self._read_off()  # the relay reads the client from now
        first, self.buffer = self.buffer, b""
        tunnel.bytes_up += len(first)
        tunnel.relay = Relay(
            self.sock,
            self.upstream,
            on_activity=self._touch,
            on_end=self._ended,
            first_up=first,
            own=True,  # the door's own sockets: the relay closes them, with the tunnel
        )
        tunnel.relay.start()

    def _touch(self) -> None:
        self.active = self.loop.time()

    def _ended(self, error: OSError | None) -> None:
        if error is not None:
            logger.debug("covey: tunnel %s ended: %s", self.id, error)
        self.close()

    # --- writing the client ------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.out:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close()
                return
            data = data[sent:]
        self.out += data
        if self.out and not self.writing:
            self.loop.add_writer(self.fd, self._writable)
            self.writing = True

    @_closing_on_error
    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        self.out = self.out[sent:]
        if self.out:
            return
        self.loop.remove_writer(self.fd)
        self.writing = False
        if self.closing:
            self.close()
        else:
            self._relay_when_ready()

    def _answer(self, status: int, reason: str) -> None:
        self._send_and_close(answer(status, reason))

    def _send_and_close(self, data: bytes) -> None:
        self.closing = True
        self._read_off()
        self._send(data)
        if not self.out:
            self.close()

    # --- the end -----------------------------------------------------------------------------

    def _hand_to_plain(self) -> None:
        """Not a CONNECT: mitmproxy's from here, with what was read (this door is done)."""
        self._read_off()
        self._forget()
        self.front.hand_to_plain(self.sock, self.buffer)

    def close(self) -> None:
        """Close the connection and its tunnel, whatever state they are in."""
        if self.closed:
            return
        self.closed = True
        if self.deciding is not None:
            self.deciding.cancel()
        self._dial_over()
        self._read_off()
        if self.writing:
            self.loop.remove_writer(self.fd)
            self.writing = False
        if self.tunnel is not None:
            self.tunnel.discard()  # the relay and the upstream
        self.sock.close()
        self._forget()

    def _forget(self) -> None:
        """This door is done: neither the front nor the addon keeps it."""
        self.closed = True
        self.front.doors.pop(self.id, None)
        self.gate.closed(self.id)
