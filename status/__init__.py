"""What every covey process that serves HTTP answers about itself, apart from its work: the
metrics token's check (the control plane, the proxy, the gateway, runner hosts), and the small
status listener of the processes that have no web server of their own (the egress proxy, runner
hosts): /healthz, /readyz and /metrics on an address of their own, in a thread.

/healthz: the process answers. /readyz: 200 or 503 with what its owner checks (a function it
gives). /metrics: the owner's registry in Prometheus's text format, to a bearer of
COVEY_METRICS_TOKEN only (without one, to nobody), as the numbers say who is busy. No Django:
the data plane uses it.
"""

import hmac
import json
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# A client that sends nothing (or too slowly) is dropped after this long: a status listener
# must keep answering its probes whoever else connects.
READ_TIMEOUT_SECONDS = 10.0

# (ready, body): what the owner's readiness function answers; the body says why.
Readiness = Callable[[], tuple[bool, dict[str, Any]]]


def metrics_refusal(authorization: str, token: str) -> tuple[int, str] | None:
    """None when the ``Authorization`` header bears the metrics token, else the status code
    and what to do (403 while no token is set: metrics are off; 401 for any other header)."""
    if not token:
        return 403, "Metrics are off: set COVEY_METRICS_TOKEN and scrape with it."
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        return 401, "Send the metrics token as 'Authorization: Bearer <token>'."
    return None


class StatusServer:
    """Serves /healthz, /readyz and /metrics on ``(host, port)`` (IPv4 or IPv6) from
    :meth:`start` until :meth:`stop`. OSError when it cannot listen there."""

    def __init__(
        self,
        address: tuple[str, int],
        ready: Readiness,
        registry: CollectorRegistry,
        *,
        token: str,
    ) -> None:
        self.ready, self.registry, self.token = ready, registry, token
        status = self

        class Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT_SECONDS

            def do_GET(self, with_body: bool = True) -> None:
                code, content_type, body = status.answer(
                    self.path, self.headers.get("Authorization", "")
                )
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET(with_body=False)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not news

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
            daemon_threads = True

        self.server = Server(address, Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="covey-status", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, authorization: str) -> tuple[int, str, bytes]:
        """The status, content type and body for a GET of ``path``."""
        route = path.split("?", 1)[0]
        if route == "/healthz":
            return _json(HTTPStatus.OK, {"status": "ok"})
        if route == "/readyz":
            ready, body = self.ready()
            body = {"status": "ready" if ready else "not ready", **body}
            return _json(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, body)
        if route == "/metrics":
            if refusal := metrics_refusal(authorization, self.token):
                code, detail = refusal
                return _json(code, {"detail": detail})
            return HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        return _json(HTTPStatus.NOT_FOUND, {"detail": "this is /healthz, /readyz and /metrics"})


def _json(code: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return code, "application/json", json.dumps(body).encode()
