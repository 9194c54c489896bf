"""Loopback-only network fixtures for egress tests: a test CA, a DNS server, HTTP(S) upstreams."""

# Nothing here touches the internet. Every server binds to an address in 127.0.0.0/8 on a free
# port (chosen by binding to port 0), runs on plain threads, and stop() (or leaving the `with`
# block) shuts down every open connection, closes every socket and joins every thread it started.
#
# Typical use:
#
#     with DnsServer() as dns, Upstream(loopback_alias(2), tls=ca.issue("api.test")) as up:
#         dns.set("api.test", up.host)
#         ...  # point the proxy at dns.nameserver, then connect to up.url(host="api.test")

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import os
import socket
import socketserver
import ssl
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast
from urllib.parse import urlsplit

import trustme
from dnslib import AAAA, QTYPE, RCODE, RR, SOA, A, DNSRecord  # type: ignore[import-untyped]
from dnslib.server import (  # type: ignore[import-untyped]
    BaseResolver,
    DNSHandler,
    DNSLogger,
    DNSServer,
)

from tests import workers

__all__ = [
    "DnsServer",
    "RecordedRequest",
    "TestCA",
    "Upstream",
    "loopback_alias",
]

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
CONNECTION_TIMEOUT = 30.0  # seconds an idle connection may block a worker thread
JOIN_TIMEOUT = 10.0  # seconds stop() waits for each thread
CHUNK_SIZE = 64 * 1024  # /bytes/<n> streams in chunks of this size
_SNI_ATTRIBUTE = "_netfixtures_sni"
_UPSTREAM_ATTRIBUTE = "_netfixtures_upstream"

type IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
type Address = str | IPAddress


def loopback_alias(n: int) -> str:
    """Return 127.0.<block>.<n>: Linux routes all of 127.0.0.0/8 to lo, so each upstream gets
    its own; the block is this test process's own (tests/workers.py), 0 without workers."""
    if not 1 <= n <= 254:
        raise ValueError(f"loopback alias must be 1..254, not {n}")
    return f"127.0.{workers.loopback_block()}.{n}"


def _require_loopback(host: str) -> str:
    """Return host unchanged if it is an IPv4 address in 127.0.0.0/8, else raise ValueError."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"bind address must be an IP in 127.0.0.0/8, not {host!r}") from None
    if address not in LOOPBACK:
        raise ValueError(f"bind address must be in 127.0.0.0/8, not {host}")
    return host


def _shutdown_socket(sock: socket.socket) -> None:
    """Shut down both directions of a socket (bypassing TLS), ignoring already-closed ones."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


# --------------------------------------------------------------------------------------------
# Test certificate authority
# --------------------------------------------------------------------------------------------


class TestCA:
    """A throwaway certificate authority (trustme) whose PEM is written to a temp directory."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path | str) -> None:
        """Create the CA and write its certificate to ``<directory>/ca.pem``."""
        self.ca = trustme.CA()
        self.ca_file = Path(directory) / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))

    def issue(self, *names: str) -> ssl.SSLContext:
        """Return a server SSLContext presenting a fresh certificate for the given names."""
        if not names:
            raise ValueError("issue() needs at least one name")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(*names).configure_cert(context)
        return context

    def client_context(self) -> ssl.SSLContext:
        """Return a client SSLContext that trusts this CA only (hostname checking on)."""
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


# --------------------------------------------------------------------------------------------
# Thread and connection bookkeeping shared by the DNS and HTTP servers
# --------------------------------------------------------------------------------------------


class _TrackedThreads:
    """socketserver mix-in: one daemon thread per request, all remembered so stop() can join."""

    thread_name = "netfixtures"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Set up the bookkeeping, then build the server."""
        self._track_lock = threading.Lock()
        self._workers: set[threading.Thread] = set()
        self._connections: set[socket.socket] = set()
        self._closing = False
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Handle the request on a new tracked daemon thread (refused once stopping)."""
        server = cast(socketserver.BaseServer, self)
        with self._track_lock:
            if self._closing:
                server.shutdown_request(request)
                return
            self._workers = {t for t in self._workers if t.is_alive()}
            worker = threading.Thread(
                target=self._run_request,
                args=(request, client_address),
                name=f"{self.thread_name}-worker",
                daemon=True,
            )
            self._workers.add(worker)
            if isinstance(request, socket.socket):
                request.settimeout(CONNECTION_TIMEOUT)
                self._connections.add(request)
        worker.start()

    def _run_request(self, request: Any, client_address: Any) -> None:
        """Run the request like ThreadingMixIn does, then forget its connection."""
        try:
            cast(socketserver.ThreadingMixIn, self).process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _swap_connection(self, old: socket.socket, new: socket.socket) -> bool:
        """Track new instead of old (TLS wrapping); False means stopping and new must close."""
        with self._track_lock:
            self._connections.discard(old)
            if self._closing:
                return False
            self._connections.add(new)
            return True

    def _forget(self, connection: Any) -> None:
        """Stop tracking a finished connection."""
        with self._track_lock:
            self._connections.discard(connection)

    def close_connections(self) -> None:
        """Refuse new requests and shut down every open connection so workers return."""
        with self._track_lock:
            self._closing = True
            connections = list(self._connections)
        for connection in connections:
            _shutdown_socket(connection)

    def join_workers(self) -> None:
        """Wait for every request thread to finish."""
        with self._track_lock:
            workers = list(self._workers)
            self._workers.clear()
        for worker in workers:
            worker.join(JOIN_TIMEOUT)


def _stop_server(server: socketserver.BaseServer, thread: threading.Thread | None) -> None:
    """Stop serve_forever, shut down open connections, close the socket and join all threads."""
    if thread is not None:
        server.shutdown()
        thread.join(JOIN_TIMEOUT)
    tracked = cast(_TrackedThreads, server)
    tracked.close_connections()
    server.server_close()
    tracked.join_workers()


# --------------------------------------------------------------------------------------------
# DNS
# --------------------------------------------------------------------------------------------


def _normalise(name: str) -> str:
    """Lower-case a DNS name and drop its trailing dot."""
    normalised = str(name).rstrip(".").lower()
    if not normalised:
        raise ValueError("empty DNS name")
    return normalised


def _addresses(
    values: Iterable[Address],
) -> tuple[IPAddress, ...]:
    """Parse addresses, raising ValueError on anything that is not an IPv4 or IPv6 address."""
    return tuple(ipaddress.ip_address(str(value)) for value in values)


class _UDPServer(_TrackedThreads, socketserver.ThreadingMixIn, socketserver.UDPServer):
    """UDP DNS listener without SO_REUSEADDR (which would let two servers share a UDP port)."""

    thread_name = "netfixtures-dns-udp"
    allow_reuse_address = False


class _TCPServer(_TrackedThreads, socketserver.ThreadingMixIn, socketserver.TCPServer):
    """TCP DNS listener."""

    thread_name = "netfixtures-dns-tcp"
    allow_reuse_address = True
    request_queue_size = 64


def _matches(address: IPAddress, qtype: int) -> bool:
    return (qtype, address.version) in ((QTYPE.A, 4), (QTYPE.AAAA, 6))


class _TableResolver(BaseResolver):
    """dnslib resolver answering from a DnsServer's table."""

    def __init__(self, table: DnsServer) -> None:
        """Answer from the given table."""
        self.table = table

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        """Answer A/AAAA from the table with the name's TTL; NXDOMAIN for unknown names."""
        reply = request.reply()
        if not request.questions:
            reply.header.rcode = RCODE.FORMERR
            return reply
        qname = request.q.qname
        qtype = request.q.qtype
        found = self.table._lookup(str(qname), qtype)
        if found is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        addresses, ttl = found
        if ttl and not any(_matches(address, qtype) for address in addresses):
            # No record of this type: an SOA says how long that answer may be kept (RFC 2308).
            soa = SOA("ns.test.", "admin.test.", (1, ttl, ttl, ttl, ttl))
            reply.add_auth(RR(qname, QTYPE.SOA, rdata=soa, ttl=ttl))
        for address in addresses:
            if qtype == QTYPE.A and address.version == 4:
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(tuple(address.packed)), ttl=ttl))
            elif qtype == QTYPE.AAAA and address.version == 6:
                reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(tuple(address.packed)), ttl=ttl))
        return reply


class DnsServer:
    """A real DNS server (UDP and TCP on one port) on loopback answering from a mutable table."""

    # Names are case-insensitive, with or without a trailing dot; answers have TTL 0 unless
    # set() gives another.
    # Unknown names get NXDOMAIN; known names get NOERROR with the A or AAAA records matching
    # the query type (possibly none). For sequence() names each A query takes the next answer
    # list (the last repeats); AAAA queries do not advance and answer from the list the next A
    # query gets, which keeps dnspython's resolve_name (AAAA, then A) consistent per resolution.

    def __init__(self, host: str = "127.0.0.1") -> None:
        """Prepare a server for the given loopback address; start() binds it."""
        self._host = _require_loopback(host)
        self._lock = threading.Lock()
        self._static: dict[str, tuple[IPAddress, ...]] = {}
        self._ttls: dict[str, int] = {}
        self._sequences: dict[str, list[tuple[IPAddress, ...]]] = {}
        self._a_queries: dict[str, int] = {}
        self._queries: dict[str, int] = {}
        self._servers: list[DNSServer] = []
        self._port: int | None = None

    # -- table --------------------------------------------------------------------------------

    def set(self, name: str, *addresses: Address, ttl: int = 0) -> None:
        """Answer name with these IPv4 (A) and IPv6 (AAAA) addresses, replacing any entry."""
        key = _normalise(name)
        parsed = _addresses(addresses)
        with self._lock:
            self._sequences.pop(key, None)
            self._static[key] = parsed
            self._ttls[key] = ttl

    def remove(self, name: str) -> None:
        """Forget name (it answers NXDOMAIN again); no error if it was not set."""
        key = _normalise(name)
        with self._lock:
            self._static.pop(key, None)
            self._ttls.pop(key, None)
            self._sequences.pop(key, None)

    def sequence(self, name: str, answers: Sequence[Sequence[Address]]) -> None:
        """Answer successive A queries for name with successive lists, the last one repeating."""
        key = _normalise(name)
        if isinstance(answers, str) or not answers:
            raise ValueError("sequence() needs a non-empty list of address lists")
        parsed = [_addresses([group] if isinstance(group, str) else group) for group in answers]
        with self._lock:
            self._static.pop(key, None)
            self._ttls.pop(key, None)
            self._sequences[key] = parsed
            self._a_queries[key] = 0

    def queries(self, name: str) -> int:
        """Return how many queries (any type, UDP or TCP) this server has seen for name."""
        with self._lock:
            return self._queries.get(_normalise(name), 0)

    def _lookup(self, name: str, qtype: int) -> tuple[tuple[IPAddress, ...], int] | None:
        """Count a query; return the name's current addresses and TTL, or None if unknown."""
        key = str(name).rstrip(".").lower()
        with self._lock:
            self._queries[key] = self._queries.get(key, 0) + 1
            if key in self._static:
                return self._static[key], self._ttls.get(key, 0)
            steps = self._sequences.get(key)
            if steps is None:
                return None
            seen = self._a_queries.get(key, 0)
            if qtype == QTYPE.A:
                self._a_queries[key] = seen + 1
            return steps[min(seen, len(steps) - 1)], 0

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The loopback address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The UDP and TCP port the server listens on (after start())."""
        if self._port is None:
            raise RuntimeError("DnsServer is not started")
        return self._port

    @property
    def nameserver(self) -> str:
        """The server as ``address@port``."""
        return f"{self.address}@{self.port}"

    def start(self) -> Self:
        """Bind UDP and TCP on one free port and serve both on background threads."""
        if self._servers:
            raise RuntimeError("DnsServer already started")
        resolver = _TableResolver(self)
        logger = DNSLogger(log="-request,-reply,-truncated,-error", logf=lambda _message: None)
        for _attempt in range(50):
            udp = DNSServer(resolver, address=self._host, port=0, logger=logger, server=_UDPServer)
            port = udp.server.server_address[1]
            try:
                tcp = DNSServer(
                    resolver, address=self._host, port=port, logger=logger, server=_TCPServer
                )
            except OSError:
                udp.server.server_close()
                continue
            break
        else:
            raise RuntimeError("no port free for both UDP and TCP on loopback")
        self._servers = [udp, tcp]
        self._port = port
        for server in self._servers:
            thread = threading.Thread(
                target=server.server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"{server.server.thread_name}-serve",
                daemon=True,
            )
            server.thread = thread
            thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close both sockets and join every thread (safe to call twice)."""
        servers, self._servers = self._servers, []
        for server in servers:
            _stop_server(server.server, getattr(server, "thread", None))

    def __enter__(self) -> Self:
        """Start the server."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server."""
        self.stop()


# --------------------------------------------------------------------------------------------
# HTTP(S) upstream
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request an Upstream received."""

    method: str
    path: str
    host: str | None
    headers: tuple[tuple[str, str], ...]
    sni: str | None
    request_line: str
    body: bytes
    client: tuple[str, int]

    def header(self, name: str) -> str | None:
        """Return the first value of a header (case-insensitive), or None."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key.lower() == wanted), None)


def _capture_sni(sock: Any, server_name: str | None, context: ssl.SSLContext) -> None:
    """sni_callback: note the SNI (None if absent) on the socket and its Upstream at ClientHello."""
    setattr(sock, _SNI_ATTRIBUTE, server_name)
    upstream = getattr(sock, _UPSTREAM_ATTRIBUTE, None)
    if upstream is not None:
        upstream._client_hello(server_name)


class _HTTPServer(_TrackedThreads, ThreadingHTTPServer):
    """ThreadingHTTPServer with tracked threads, optional per-connection TLS and no DNS lookups."""

    thread_name = "netfixtures-upstream"
    request_queue_size = 128
    upstream: Upstream

    def server_bind(self) -> None:
        """Bind without HTTPServer's getfqdn() (a reverse DNS lookup)."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Do the TLS handshake (if any) on the worker thread, then run the handler."""
        upstream = self.upstream
        upstream._connection_opened()
        try:
            if not request.recv(1, socket.MSG_PEEK):
                return  # closed without a byte
        except OSError:
            return
        upstream._connection_spoke()
        tls = upstream.tls
        if tls is None:
            super().finish_request(request, client_address)
            return
        connection = tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        try:
            if not self._swap_connection(request, connection):
                return
            setattr(connection, _UPSTREAM_ATTRIBUTE, upstream)
            try:
                connection.do_handshake()
            except (OSError, ValueError):
                return
            super().finish_request(connection, client_address)
        finally:
            self._forget(connection)
            connection.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Keep stderr quiet; remember unexpected handler errors on the Upstream."""
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, OSError | ValueError):
            self.upstream._error(error)


WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def websocket_frame(payload: bytes, *, mask: bool) -> bytes:
    """One final text frame of under 126 bytes (a client's is masked)."""
    if len(payload) >= 126:
        raise ValueError("only short frames")
    if not mask:
        return bytes([0x81, len(payload)]) + payload
    key = os.urandom(4)
    masked = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return bytes([0x81, 0x80 | len(payload)]) + key + masked


def read_websocket_frame(stream: Any) -> bytes | None:
    """The payload of one short frame read from a file-like ``stream``; None at a close frame
    or the end of the stream."""
    head = stream.read(2)
    if len(head) < 2 or head[0] & 0x0F == 0x8:
        return None
    length = head[1] & 0x7F
    if length >= 126:
        raise ValueError("only short frames")
    key = stream.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    payload = stream.read(length)
    return bytes(b ^ key[i % 4] for i, b in enumerate(payload))


class _Handler(BaseHTTPRequestHandler):
    """Routes: ``/`` hello, ``/bytes/<n>`` n streamed bytes, ``/echo`` the request as JSON."""

    protocol_version = "HTTP/1.1"
    server_version = "netfixtures-upstream"
    sys_version = ""
    timeout = CONNECTION_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing."""

    def do_GET(self) -> None:
        """Record and answer the request."""
        self._serve()

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

    def _serve(self) -> None:
        """Record the request, then route it."""
        upstream = cast(_HTTPServer, self.server).upstream
        body = self._read_body()
        sni = getattr(self.request, _SNI_ATTRIBUTE, None)
        record = RecordedRequest(
            method=self.command,
            path=self.path,
            host=self.headers.get("Host"),
            headers=tuple(self.headers.items()),
            sni=sni,
            request_line=self.requestline,
            body=body,
            client=(str(self.client_address[0]), int(self.client_address[1])),
        )
        upstream._record(record)
        route = urlsplit(self.path).path or "/"
        if route == "/":
            self._send(200, f"hello from {upstream.name}".encode(), "text/plain; charset=utf-8")
        elif route == "/echo":
            echo = {
                "request_line": self.requestline,
                "method": self.command,
                "path": self.path,
                "version": self.request_version,
                "host": record.host,
                "headers": [list(pair) for pair in record.headers],
                "sni": sni,
                "body": body.decode("utf-8", "replace"),
            }
            self._send(200, json.dumps(echo).encode(), "application/json")
        elif route.startswith("/bytes/"):
            self._send_bytes(route.removeprefix("/bytes/"))
        elif route == "/websocket" and self.headers.get("Upgrade", "").lower() == "websocket":
            self._echo_websocket()
        else:
            self._send(404, b"not found", "text/plain; charset=utf-8")

    def _echo_websocket(self) -> None:
        """Upgrade to a WebSocket (RFC 6455) and send back each short text frame, until the
        client closes."""
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(
            hashlib.sha1((key + WEBSOCKET_GUID).encode(), usedforsecurity=False).digest()
        )
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept.decode())
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            try:
                payload = read_websocket_frame(self.rfile)
            except (OSError, ValueError):
                return
            if payload is None:
                return
            self.wfile.write(websocket_frame(payload, mask=False))
            self.wfile.flush()

    def _read_body(self) -> bytes:
        """Read a Content-Length body; close after the response if the body cannot be framed."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            return b""
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            return self.rfile.read(int(length))
        except ValueError:
            self.close_connection = True
            return b""

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        """Send a complete response with Content-Length (no body for HEAD)."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_bytes(self, count: str) -> None:
        """Stream count bytes in 64 KiB chunks with Content-Length."""
        if not count.isdigit():
            self._send(400, b"bad byte count", "text/plain; charset=utf-8")
            return
        remaining = int(count)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(remaining))
        self.end_headers()
        if self.command == "HEAD":
            return
        chunk = b"x" * CHUNK_SIZE
        while remaining > 0:
            piece = chunk if remaining >= CHUNK_SIZE else chunk[:remaining]
            self.wfile.write(piece)
            remaining -= len(piece)


class Upstream:
    """A threaded HTTP/1.1 server, optionally TLS, on a loopback address, recording requests."""

    # GET / answers "hello from <name>"; GET /bytes/<n> streams n bytes; GET /echo returns the
    # request line, headers, Host and SNI as JSON. Other methods route the same way.

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        name: str = "upstream",
        tls: ssl.SSLContext | None = None,
        port: int = 0,
    ) -> None:
        """Prepare an upstream on host (127.0.0.0/8) and port (0: any free one), maybe TLS."""
        self._host = _require_loopback(host)
        self._wanted_port = port
        self.name = name
        self.tls = tls
        if tls is not None and tls.sni_callback is not _capture_sni:
            if tls.sni_callback is not None:
                raise ValueError("the SSLContext already has an sni_callback")
            tls.sni_callback = _capture_sni
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []
        self._snis: list[str | None] = []
        self._errors: list[BaseException] = []
        self._connections = 0
        self._spoken = 0
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    # -- records ------------------------------------------------------------------------------

    def _record(self, request: RecordedRequest) -> None:
        """Remember a request."""
        with self._lock:
            self._requests.append(request)

    def _client_hello(self, sni: str | None) -> None:
        """Remember the SNI (or None) of a ClientHello, whether or not the handshake succeeds."""
        with self._lock:
            self._snis.append(sni)

    def _connection_opened(self) -> None:
        """Count an accepted TCP connection."""
        with self._lock:
            self._connections += 1

    def _connection_spoke(self) -> None:
        """Count a TCP connection on which a byte arrived."""
        with self._lock:
            self._spoken += 1

    def _error(self, error: BaseException) -> None:
        """Remember an unexpected handler error."""
        with self._lock:
            self._errors.append(error)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def last_request(self) -> RecordedRequest | None:
        """The most recent request, or None."""
        with self._lock:
            return self._requests[-1] if self._requests else None

    @property
    def sni(self) -> str | None:
        """The SNI of the most recent TLS ClientHello (None if none yet, or it had no SNI)."""
        with self._lock:
            return self._snis[-1] if self._snis else None

    @property
    def snis(self) -> list[str | None]:
        """The SNI of every TLS ClientHello, oldest first (None where the client sent none)."""
        with self._lock:
            return list(self._snis)

    @property
    def connections(self) -> int:
        """How many TCP connections were accepted."""
        with self._lock:
            return self._connections

    @property
    def spoken(self) -> int:
        """How many TCP connections sent at least one byte (a proxy may dial the upstream of a
        tunnel before it checks the tunnel's first bytes: a refused tunnel's dial says nothing)."""
        with self._lock:
            return self._spoken

    @property
    def errors(self) -> list[BaseException]:
        """Unexpected exceptions raised by request handlers (kept off stderr)."""
        with self._lock:
            return list(self._errors)

    def reset(self) -> None:
        """Forget recorded requests, SNIs, errors and the connection count."""
        with self._lock:
            self._requests.clear()
            self._snis.clear()
            self._errors.clear()
            self._connections = 0
            self._spoken = 0

    # -- addressing ---------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The loopback address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on (after start())."""
        if self._port is None:
            raise RuntimeError("Upstream is not started")
        return self._port

    @property
    def scheme(self) -> str:
        """``https`` when serving TLS, else ``http``."""
        return "https" if self.tls is not None else "http"

    def url(self, path: str = "/", host: str | None = None) -> str:
        """Return the URL of path here; host replaces the address (e.g. a name the DNS serves)."""
        if not path.startswith("/"):
            path = "/" + path
        return f"{self.scheme}://{host or self.host}:{self.port}{path}"

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        """Bind a free port and serve on a background thread."""
        if self._server is not None:
            raise RuntimeError("Upstream already started")
        server = _HTTPServer((self._host, self._wanted_port), _Handler, bind_and_activate=False)
        server.upstream = self
        try:
            server.server_bind()
            server.server_activate()
        except BaseException:
            server.server_close()
            raise
        self._server = server
        self._port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"netfixtures-upstream-{self.name}-serve",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Shut down, close open connections and the socket, join every thread (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            _stop_server(server, thread)

    def __enter__(self) -> Self:
        """Start the server."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server."""
        self.stop()
