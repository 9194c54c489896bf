"""The one place covey leans on gunicorn's insides, to move a home transfer's bytes without
copying them through Python: most of a transfer's cost on the control plane was copies (every
chunk read into Python and written again, and a request body copied several times over in
gunicorn's buffers). Both ways are taken only when what they rely on is seen to hold, and a
request or response that does not qualify goes the usual way through the server;
tests/homes/test_transfers.py checks them against gunicorn's own parser and response.

- Out: a response of known length to a GET over plain HTTP/1.x sends the spool file's bytes past
  its first chunk with ``sendfile`` on the connection's socket (``gunicorn.socket``). gunicorn
  writes each chunk it is given at once, so bytes sent beside it go out in order, after the
  headers the first chunk carried.
- In: a request body of known length of which gunicorn has read nothing yet (its buffers are
  empty: the client waited for 100 Continue, as curl and runners do) is read straight from the
  socket, one copy a MiB; gunicorn is then told the body is read (the connection may carry the
  next request) or, until then, that it broke off (it closes the connection after the answer).
"""

import contextlib
import io
import socket
import ssl
from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest
from rest_framework import exceptions

from covey.numbers import whole_number
from homes.services import CHUNK, IDLE_SECONDS, HomeProblem, Wire

HTTP_1 = ("HTTP/1.0", "HTTP/1.1")


def sender(request: HttpRequest) -> Wire | None:
    """How a response to ``request`` may send a file's bytes without reading them: the
    socket's ``sendfile`` for a GET over plain HTTP/1.x under gunicorn. None otherwise (HEAD
    sends no body, TLS would read the file 8 KiB at a time, HTTP/2 multiplexes the socket,
    another server hands over no socket)."""
    sock = request.META.get("gunicorn.socket")
    if request.method != "GET" or request.META.get("SERVER_PROTOCOL") not in HTTP_1:
        return None
    if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
        return None
    return sock.sendfile


def read(request: HttpRequest, size: int) -> Iterator[bytes]:
    """A request body of ``size`` bytes, a MiB at a time: from the socket when gunicorn has
    read none of it (:func:`untouched`), else through the server."""
    found = untouched(request, size)
    if found is not None:
        request._read_started = True  # type: ignore[attr-defined]  # from the socket only
        yield from received(*found, size)
        return
    left = size
    while left > 0:
        data = request.read(min(CHUNK, left))
        if not data:
            raise HomeProblem(400, f"the body ended {left} bytes short of its length")
        left -= len(data)
        yield data


def untouched(request: HttpRequest, size: int) -> tuple[socket.socket, Any] | None:
    """The connection's socket and gunicorn's body of the request, when all ``size`` bytes of
    the body are still on the socket: gunicorn's body (``Body`` over a ``LengthReader`` over
    the connection's unreader) says so, with its buffers empty, and nothing read it through
    Django. None otherwise, and for a gunicorn shaped otherwise."""
    sock = request.META.get("gunicorn.socket")
    stream = request.META.get("wsgi.input")
    reader = getattr(stream, "reader", None)
    if not isinstance(sock, socket.socket) or getattr(request, "_read_started", True):
        return None
    if request.META.get("SERVER_PROTOCOL") not in HTTP_1:
        return None
    if getattr(reader, "length", None) != size or getattr(stream, "failed", None) is not False:
        return None
    held = (getattr(stream, "buf", None), getattr(getattr(reader, "unreader", None), "buf", None))
    if not all(isinstance(buffer, io.BytesIO) and not buffer.getvalue() for buffer in held):
        return None
    return sock, stream


def received(sock: socket.socket, stream: Any, size: int) -> Iterator[bytes]:
    """A body of ``size`` bytes read from the connection a MiB at a time. Until it is all
    read, gunicorn's body says it broke off (so nothing drains a body paused part-way, and
    the connection closes after the answer: where a next request would start is unknown);
    then that it is read. A sender that stands still for IDLE_SECONDS is broken off."""
    stream.failed = True
    said = sock.gettimeout()
    sock.settimeout(IDLE_SECONDS)
    left = size
    try:
        while left > 0:
            data = sock.recv(min(CHUNK, left))
            if not data:
                raise HomeProblem(400, f"the body ended {left} bytes short of its length")
            left -= len(data)
            yield data
    except TimeoutError:
        raise HomeProblem(400, f"the body stood still for {IDLE_SECONDS:.0f} s") from None
    finally:
        with contextlib.suppress(OSError):  # (a paused reader may be collected after it closed)
            sock.settimeout(said)
    stream.reader.length = 0
    stream.failed = False


def body(request: HttpRequest, *, consume: bool = True) -> tuple[Iterator[bytes], int | None]:
    """A request's body in chunks, never read whole; its length when it said one. A chunked
    body is read from the server's stream (gunicorn ends it: ``wsgi.input_terminated``)."""
    raw = request.META.get("CONTENT_LENGTH")
    if raw:
        size = whole_number(raw)
        if size is None:
            raise exceptions.ParseError("Content-Length: give a number of bytes")
        return (read(request, size) if consume else iter(())), size
    if request.META.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked" and request.META.get(
        "wsgi.input_terminated"
    ):
        stream = request.META["wsgi.input"]
        return iter(lambda: stream.read(CHUNK), b""), None
    raise exceptions.ParseError("give the body's length (Content-Length)")


DRAIN_MAX = 64 * CHUNK


def drain(request: HttpRequest) -> None:
    """Read what is left of a refused request's body (up to DRAIN_MAX), so the connection can
    carry the next request: the server cannot be told to close it after the answer."""
    try:
        raw = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return
    if raw <= 0 or raw > DRAIN_MAX:
        return
    if getattr(request.META.get("wsgi.input"), "failed", False):
        return  # broken off, or read on the socket (above): gunicorn closes it
    try:
        while request.read(CHUNK):
            pass
    except OSError:
        pass
