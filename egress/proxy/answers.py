"""What the proxy reads from a request and says back: the refusal an agent can act on, and
what makes a plain request or a tunnel's first bytes unfit for the decision."""

from mitmproxy import http
from mitmproxy.net.check import is_valid_host
from mitmproxy.net.http import http1
from mitmproxy.net.tls import starts_like_tls_record

from egress.policy import EXPLANATIONS, Code, Decision, status_of
from egress.proxy.desk import command_for

MAX_CLIENT_HELLO = 64 * 1024
# A ClientHello fits in one record, a few at most; every piece of a tunnel's first bytes parses
# all its records again, so thousands of tiny ones would cost the event loop seconds.
MAX_CLIENT_HELLO_RECORDS = 64
_NOT_TLS = "the tunnel did not start with a TLS ClientHello"


def refusal(decision: Decision) -> http.Response:
    """The answer to a refused connection: status, deny reason and how to ask for access."""
    code = decision.code
    target = f"{decision.host}:{decision.port}"
    lines = [f"covey refused {target}: {EXPLANATIONS.get(code, str(code))} ({code})."]
    if decision.detail:
        lines.append(decision.detail)
    who = f"agent {decision.username}" if decision.username else "your agent"
    if code in (Code.NOT_ON_ALLOWLIST, Code.PORT_NOT_ALLOWED):
        lines.append(
            f"If {who} needs {target}, ask for it, and a person on your platform team will"
            f" decide: {command_for(decision.host, decision.port)}"
            " (then: covey-request status ID --wait). Do not try another route."
        )
    elif code is Code.NON_PUBLIC_ADDRESS:
        lines.append(
            f"{target} resolves to a private address, which no allowlist entry opens: if {who}"
            " needs it, a person on your platform team must allow that network. Do not try"
            " another route."
        )
    headers = {"X-Covey-Deny-Reason": str(code), "Content-Type": "text/plain; charset=utf-8"}
    if code is Code.PROXY_AUTH:
        headers["Proxy-Authenticate"] = 'Basic realm="covey egress"'
    if code is Code.CAPACITY:
        headers["Retry-After"] = "1"
    return http.Response.make(status_of(code), "\n".join(lines) + "\n", headers)


def answer(status: int, reason: str) -> bytes:
    """A short plain-text answer after which the proxy closes the connection."""
    response = http.Response.make(
        status, reason + "\n", {"Content-Type": "text/plain", "Connection": "close"}
    )
    return http1.assemble_response(response)


def plain_http_problem(request: http.Request) -> str:
    """Why a plain-HTTP proxy request is ambiguous, or '' when it names one host clearly.

    mitmproxy has already taken the host from the absolute URL (or, for an origin-form
    request, from the Host header); a Host header that names anything else is refused, and
    the request goes out with the decided host only.
    """
    if request.scheme != "http":
        return "only http:// URLs can be sent as plain requests; use CONNECT for TLS"
    host_headers = request.headers.get_all("Host")
    if len(host_headers) > 1:
        return "more than one Host header"
    if host_headers:
        given = host_headers[0].strip().lower().rstrip(".")
        expected = {
            request.host.lower().rstrip("."),
            f"{request.host.lower().rstrip('.')}:{request.port}",
        }
        if given not in expected:
            return f"the Host header ({host_headers[0]!r}) does not match the URL's host"
    return ""


def read_client_hello(data: bytes) -> tuple[str, str] | None:
    """A tunnel's first bytes as ``(sni, problem)`` for :func:`egress.policy.check_client_hello`;
    None while they may still become a whole ClientHello."""
    if len(data) < 3:
        return None if data in (b"", b"\x16", b"\x16\x03") else ("", _NOT_TLS)
    if not starts_like_tls_record(data):
        return "", _NOT_TLS
    records, more = _first_records(data, MAX_CLIENT_HELLO_RECORDS)
    try:
        whole, sni = client_hello_sni(records)
    except ValueError:
        return "", "the tunnel did not start with a valid TLS ClientHello"
    if not whole:
        if more:
            return "", "the ClientHello is split into too many records"
        return ("", "the ClientHello is too large") if len(data) > MAX_CLIENT_HELLO else None
    return sni or "", ""


class _Short(ValueError):
    """A length in the ClientHello points past its end."""


def client_hello_sni(data: bytes) -> tuple[bool, str | None]:
    """Whether ``data`` (TLS records) holds a whole ClientHello, and its SNI: what mitmproxy's
    ``parse_client_hello(data).sni`` gives (its checks and its choice of name, kept the same by
    tests/egress/test_answers.py against it), read with a few slices instead of its generated
    parser's hundred calls (that was the costliest step of a tunnel). ValueError when the bytes
    are not a ClientHello.

    The SNI is the first server_name extension that names exactly one host of type host_name,
    a valid host name or address; None when there is none. Every extension's length must hold,
    and those of server_name and ALPN their lists' lengths, as mitmproxy's parser requires."""
    hello = b""
    at = 0
    while len(data) >= at + 5:  # the handshake records' bodies, until the message is whole
        header = data[at : at + 5]
        if not starts_like_tls_record(header):
            raise ValueError(f"Expected TLS record, got {header!r} instead.")
        size = int.from_bytes(header[3:5])
        if size == 0:
            raise ValueError("Record must not be empty.")
        at += 5
        if len(data) < at + size:
            break
        hello += data[at : at + size]
        at += size
        if len(hello) >= 4 and len(hello) >= (whole := int.from_bytes(hello[1:4]) + 4):
            return True, _sni(hello[4:whole])
    return False, None


def _sni(body: bytes) -> str | None:
    hello = _Bytes(body)
    hello.take(2 + 32)  # version, random
    hello.take(hello.take(1)[0])  # session id
    hello.take(int.from_bytes(hello.take(2)) // 2 * 2)  # cipher suites
    hello.take(hello.take(1)[0])  # compression methods
    if hello.done:
        return None  # no extensions
    hello.take(2)  # their length (each extension's own are what count)
    sni: str | None = None
    while not hello.done:
        kind = int.from_bytes(hello.take(2))
        extension = _Bytes(hello.take(int.from_bytes(hello.take(2))))
        if kind == 0:  # server_name: a list's length, then (type, length, name) to its end
            extension.take(2)
            names = []
            while not extension.done:
                name_type = extension.take(1)[0]
                names.append((name_type, extension.take(int.from_bytes(extension.take(2)))))
            if sni is None and len(names) == 1 and names[0][0] == 0 and is_valid_host(names[0][1]):
                sni = names[0][1].decode("ascii")
        elif kind == 16:  # ALPN: a list's length, then (length, protocol) to its end
            extension.take(2)
            while not extension.done:
                extension.take(extension.take(1)[0])
    return sni


class _Bytes:
    """Reading ``data`` from the front; a read past its end is :class:`_Short`."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    @property
    def done(self) -> bool:
        return self.at >= len(self.data)

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.data):
            raise _Short("Invalid ClientHello")
        self.at += size
        return self.data[self.at - size : self.at]


def _first_records(data: bytes, count: int) -> tuple[bytes, bool]:
    """The first ``count`` TLS records of ``data`` (all of it when it holds no more), and
    whether bytes follow them."""
    end = 0
    for _ in range(count):
        if end + 5 > len(data):
            return data, False
        end += 5 + int.from_bytes(data[end + 3 : end + 5])
        if end >= len(data):
            return data, False
    return data[:end], True
