"""The proxy's request desk: where a sandbox files a request for a package or a route, and asks
how it was decided, through the only host it can reach under hard isolation (the proxy).

A sandbox sends plain HTTP through its proxy (its ``HTTP_PROXY``, with its per-run credential)
to ``http://requests.covey.invalid/`` (``.invalid`` is reserved: no real host can have that
name). The proxy answers itself, never forwarding: it identifies the agent from the credential
as it does for every connection, and passes the request on to the control plane with its
runner token (or, on the control-plane host, to the database), with the SHA-256 of the
credential, so the control plane knows the agent and the run. ``covey-request`` in sandboxes
is the client:

- ``POST /v1/requests`` ``{"kind": "egress", "target": "host[:port]", "reason": "…"}`` or
  ``{"kind": "package", "ecosystem": "apt", "package": "name[=version]", "reason": "…"}``
- ``GET /v1/requests/<id>``

The answer is JSON: ``{"id", "kind", "what", "status"}``, and once decided ``decision``,
``note`` and ``changed`` (what it changed); errors are ``{"detail": …}`` with the status the
control plane gave, and a body refused for what it holds (here: NaN, a lone surrogate, deep
nesting; there: the REST API's own validation of a filing) is a 400 that also names each
field wrong: ``{"reason": ["…"], "detail": "reason: …"}``.

No Django here: it runs in the egress image.
"""

import json
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from mitmproxy import http

import jsonbodies
from egress.environment import DESK_HOST

HOST = DESK_HOST
MAX_BODY = 16 * 1024
_ONE = re.compile(r"/v1/requests/(\d{1,12})/?")

# (token SHA-256, the filing) → (HTTP status, JSON body); (token SHA-256, id) → the same.
Filer = Callable[[str, Mapping[str, Any]], tuple[int, Mapping[str, Any]]]
Status = Callable[[str, int], tuple[int, Mapping[str, Any]]]


class Desk:
    """Answers the desk's requests with what ``file`` and ``status`` (the control plane, or
    the database) say."""

    def __init__(self, file: Filer, status: Status) -> None:
        self.file = file
        self.status = status

    def answer(self, method: str, path: str, body: bytes, token_sha256: str) -> http.Response:
        """The answer to one request of an identified agent (blocking: call it in a thread)."""
        path = path.split("?", 1)[0]
        try:
            if method == "POST" and path.rstrip("/") == "/v1/requests":
                if len(body) > MAX_BODY:
                    return _json(413, {"detail": f"a request is at most {MAX_BODY} bytes"})
                try:
                    filing = jsonbodies.loads(body or b"{}")
                except jsonbodies.Malformed as exc:
                    return _json(400, malformed(exc))
                if not isinstance(filing, dict):
                    return _json(400, {"detail": "the body is not a JSON object"})
                return _json(*self.file(token_sha256, filing))
            if method == "GET" and (match := _ONE.fullmatch(path)):
                return _json(*self.status(token_sha256, int(match.group(1))))
        except OSError as exc:  # the control plane did not answer
            return _json(503, {"detail": f"the control plane did not answer ({exc}); try again"})
        return _json(404, {"detail": "POST /v1/requests, or GET /v1/requests/<id>"})


def malformed(exc: jsonbodies.Malformed) -> dict[str, Any]:
    """What is wrong with a body that is not JSON the control plane can take (NaN, a lone
    surrogate, deep nesting: 400, not a 503 telling the agent to try again), naming the field as
    the control plane's refusals do."""
    shown = {"detail": f"the body is not JSON covey takes: {exc}"}
    return shown if exc.field is None else {exc.field: [exc.message], **shown}


def too_large() -> http.Response:
    return _json(413, {"detail": f"a request is at most {MAX_BODY} bytes, with a Content-Length"})


def failed() -> http.Response:
    return _json(500, {"detail": "the proxy could not take the request; try again"})


def command_for(host: str, port: int) -> str:
    """The exact command an agent runs to ask for a route it was refused."""
    target = host if port == 443 else f"{host}:{port}"
    return f'covey-request egress {shlex.quote(target)} --reason "why the agent needs it"'


def _json(status: int, body: Mapping[str, Any]) -> http.Response:
    return http.Response.make(
        status,
        json.dumps(body, sort_keys=True) + "\n",
        {"Content-Type": "application/json", "Cache-Control": "no-store"},
    )
