"""What the proxy reads from a request and says back: the refusal an agent can act on, and
what makes a plain request or a tunnel's first bytes unfit for the decision."""

from mitmproxy import http
from mitmproxy.net.http import http1
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello

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
        hello = parse_client_hello(records)
    except ValueError:
        return "", "the tunnel did not start with a valid TLS ClientHello"
    if hello is None:
        if more:
            return "", "the ClientHello is split into too many records"
        return ("", "the ClientHello is too large") if len(data) > MAX_CLIENT_HELLO else None
    return hello.sni or "", ""


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
