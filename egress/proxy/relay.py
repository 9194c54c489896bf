"""Move a checked tunnel's bytes between two sockets straight from the event loop.

Once covey has decided a tunnel and checked its ClientHello, the bytes are opaque: nothing in
them is looked at again. mitmproxy would still carry every 64 KiB chunk through its layers,
locks and hooks; a :class:`Relay` instead reads from one socket into a buffer and writes it to
the other from a reader callback, a few microseconds a chunk, with the same backpressure (a
side that cannot take more stops the reading from the other side).

For a tunnel of mitmproxy's, the relay works on duplicates of the two sockets' descriptors, so
the asyncio transports that own the originals stay as they are (paused) and close them as usual
when the tunnel ends; the front door's tunnels give it their own sockets (``own``).
"""

import asyncio
import socket
from collections.abc import Callable
from typing import Protocol

# One buffer for every relay: a callback reads and writes before it returns, and what a peer
# did not take is copied out, so no two callbacks ever share bytes in it.
_BUFFER = memoryview(bytearray(256 * 1024))


class Endpoint(Protocol):
    """A connected stream socket (a socket, or asyncio's wrapper of a transport's socket)."""

    @property
    def family(self) -> int: ...

    @property
    def type(self) -> int: ...

    def fileno(self) -> int: ...


class _Direction:
    """Bytes from ``source`` to ``target``."""

    __slots__ = ("bytes", "done", "pending", "source", "target")

    def __init__(self, source: socket.socket, target: socket.socket) -> None:
        self.source = source
        self.target = target
        self.pending = b""  # read but not yet taken by the target
        self.bytes = 0
        self.done = False  # the source has ended (EOF) and the target has been told


class Relay:
    """Relays between two connected, non-blocking stream sockets until both sides have ended.

    ``first_up`` is sent to the server before anything read from the client (the ClientHello
    the proxy checked). With ``own``, the relay takes the two sockets as they are and closes
    them when it ends; else it works on duplicates and leaves the originals open.
    ``on_activity`` is called whenever bytes move; ``on_end`` once when the relay ends by
    itself, with the error that ended it or None when both sides closed in order. :meth:`close`
    stops it at any time, without calling ``on_end``.
    """

    def __init__(
        self,
        client: Endpoint,
        server: Endpoint,
        *,
        on_activity: Callable[[], None],
        on_end: Callable[[OSError | None], None],
        first_up: bytes = b"",
        own: bool = False,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        if own:
            assert isinstance(client, socket.socket) and isinstance(server, socket.socket)  # noqa: S101
            self._client, self._server = client, server
        else:
            self._client, self._server = _duplicate(client), _duplicate(server)
        self.up = _Direction(self._client, self._server)
        self.down = _Direction(self._server, self._client)
        self.up.pending = first_up
        self._on_activity = on_activity
        self._on_end: Callable[[OSError | None], None] | None = on_end

    @property
    def closed(self) -> bool:
        return self._on_end is None

    def start(self) -> None:
        for direction in (self.up, self.down):
            if direction.pending:  # sent first: the source is read once the target took it
                self._writable(direction, waiting=False)
                if self.closed:
                    return
            else:
                self._loop.add_reader(direction.source.fileno(), self._readable, direction)

    def close(self) -> None:
        """Stop relaying and close its sockets (duplicates: the originals stay open); no
        ``on_end``."""
        self._stop()

    def _stop(self) -> Callable[[OSError | None], None] | None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            for sock in (self._client, self._server):
                self._loop.remove_reader(sock.fileno())
                self._loop.remove_writer(sock.fileno())
                sock.close()
        return on_end

    def _finish(self, error: OSError | None = None) -> None:
        """The relay ended by itself: stop, then tell ``on_end``."""
        on_end = self._stop()
        if on_end is not None:
            on_end(error)

    def _readable(self, direction: _Direction) -> None:
        try:
            n = direction.source.recv_into(_BUFFER)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._finish(exc)
        if n == 0:
            return self._ended(direction)
        direction.bytes += n
        self._on_activity()
        try:
            sent = direction.target.send(_BUFFER[:n])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            return self._finish(exc)
        if sent < n:
            # The target is full: keep the rest and stop reading until it has taken it.
            direction.pending = bytes(_BUFFER[sent:n])
            self._loop.remove_reader(direction.source.fileno())
            self._loop.add_writer(direction.target.fileno(), self._writable, direction)

    def _writable(self, direction: _Direction, *, waiting: bool = True) -> None:
        """Send what the target has not taken yet; ``waiting``: from its writer callback (else
        the first try, with none registered)."""
        try:
            sent = direction.target.send(direction.pending)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            return self._finish(exc)
        direction.pending = direction.pending[sent:]
        if sent:
            self._on_activity()
        if direction.pending:
            if not waiting:
                self._loop.add_writer(direction.target.fileno(), self._writable, direction)
            return
        if waiting:
            self._loop.remove_writer(direction.target.fileno())
        self._loop.add_reader(direction.source.fileno(), self._readable, direction)

    def _ended(self, direction: _Direction) -> None:
        """The source sent EOF: pass it on as a half-close; end when both sides have."""
        self._loop.remove_reader(direction.source.fileno())
        direction.done = True
        try:
            direction.target.shutdown(socket.SHUT_WR)
        except OSError as exc:
            return self._finish(exc)
        if self.up.done and self.down.done:
            self._finish()


def _duplicate(sock: Endpoint) -> socket.socket:
    duplicate = socket.fromfd(sock.fileno(), sock.family, sock.type)
    duplicate.setblocking(False)
    return duplicate
