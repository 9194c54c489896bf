"""The one module a runner uses to speak HTTP to the control plane (with its runner token)."""

import http.client
import json
import os
import selectors
import socket
import ssl
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import httpx

from egress.environment import Isolation
from runners.probe.checks import Result
from runners.protocol import (
    FEATURES,
    HOME_ANSWER_HEADER,
    MAX_PROBLEM_CHARS,
    OUTPUT_TOTAL_HEADER,
    ActiveRun,
    ActiveRuns,
    Heartbeat,
    HomeAnswer,
    HomeOrder,
    LaunchSpec,
    Message,
    OutputAnswer,
    OutputChunk,
    PauseOrder,
    ProbeBegin,
    ProbePlan,
    ProbeReport,
    ProbeStatusAnswer,
    ProtocolError,
    Registered,
    Registration,
    RunnerInfo,
    RunReport,
    RunStart,
    RunStatusAnswer,
)


class ControlPlaneError(Exception):
    """The control plane refused or could not be reached; the message says which."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of a refusal; None when unreachable


class OutputBehind(Exception):
    """The control plane holds another amount of a run's output than was assumed."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the control plane has {size} bytes of this run's output")
        self.size = size


class OutputClosed(Exception):
    """The control plane takes no more of a run's output live (the whole log comes at the end)."""


class ControlPlaneClient:
    """A runner's view of the control-plane API."""

    def __init__(self, url: str, token: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Runner {token}"},
            timeout=timeout,
            trust_env=False,  # never send the control plane's traffic through a proxy
        )
        self._tls_context: ssl.SSLContext | None = None

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def set_token(self, token: str) -> None:
        """Use a renewed runner token from now on."""
        self._client.headers["Authorization"] = f"Runner {token}"

    def me(self) -> RunnerInfo:
        """Who this runner is (id, name, organisation, labels, paused, queue)."""
        return _answer(RunnerInfo, self._request("GET", "/api/v1/runner/"))

    def heartbeat(
        self, isolation: Isolation | None = None, problem: str | None = None
    ) -> RunnerInfo:
        """Tell the control plane this runner is alive, what it enforces and whether it can
        take work (``problem``: '' when it can, else why not; None: not said); answers like
        :meth:`me`."""
        if problem is not None:
            problem = problem[:MAX_PROBLEM_CHARS]
        beat = Heartbeat(isolation, None if problem is None else not problem, problem)
        return _answer(
            RunnerInfo, self._request("POST", "/api/v1/runner/", json=_without_unsaid(beat))
        )

    def begin_probe(
        self, probe_id: str | None, isolation: Isolation, reason: str = ""
    ) -> ProbePlan | None:
        """What an egress probe is to try (a new one when ``probe_id`` is None); None when the
        ordered probe is no longer this runner's to run."""
        probe = None if probe_id is None else uuid.UUID(probe_id)
        body = ProbeBegin(isolation, probe, reason).to_json()
        response = self._request("POST", "/api/v1/runner/probes/", json=body, allow=(409,))
        if response.status_code == 409:
            return None
        return _answer(ProbePlan, response)

    def report_probe(
        self, probe_id: str, results: Sequence[Result], detail: str = ""
    ) -> ProbeStatusAnswer:
        """What the probe saw, one result per check (or none, and why it could not run)."""
        response = self._request(
            "POST",
            f"/api/v1/runner/probes/{probe_id}/report/",
            json=ProbeReport(tuple(results), detail).to_json(),
        )
        return _answer(ProbeStatusAnswer, response)

    def pause(self, paused: bool) -> RunnerInfo:
        """Pause the runner (what runs finishes, nothing new starts), or resume it."""
        body = PauseOrder(paused).to_json()
        return _answer(RunnerInfo, self._request("POST", "/api/v1/runner/pause/", json=body))

    def active_runs(self) -> tuple[ActiveRun, ...]:
        """The runs the control plane expects this runner to have a sandbox for."""
        return _answer(ActiveRuns, self._request("GET", "/api/v1/runner/runs/")).runs

    def start_run(self, run_id: str) -> LaunchSpec | None:
        """The sandbox spec of a run this runner is to start; None when it no longer is."""
        response = self._request(
            "POST",
            f"/api/v1/runner/runs/{run_id}/start/",
            json=RunStart(FEATURES).to_json(),
            allow=(409,),
        )
        if response.status_code == 409:
            return None
        return _answer(LaunchSpec, response)

    def report(self, run_id: str, seen: RunReport) -> RunStatusAnswer:
        """What this runner saw of a run's sandbox: running, exited, built (failed), vanished."""
        response = self._request(
            "POST", f"/api/v1/runner/runs/{run_id}/report/", json=seen.to_json()
        )
        return _answer(RunStatusAnswer, response)

    def put_log(self, run_id: str, text: str, total: int | None = None) -> None:
        """Send a finished run's whole output (``total``: how many bytes the sandbox wrote in
        all, when counted; Docker keeps only the last of a large output)."""
        headers = {"Content-Type": "text/plain; charset=utf-8"}
        if total is not None:
            headers[OUTPUT_TOTAL_HEADER] = str(total)
        self._request(
            "PUT",
            f"/api/v1/runner/runs/{run_id}/log/",
            content=text.encode(),
            headers=headers,
            timeout=60,
        )

    def put_output(self, run_id: str, offset: int, text: str) -> int:
        """Send output of a running sandbox that starts ``offset`` bytes into it; returns the
        size the control plane now has. OutputBehind when it has another size."""
        response = self._request(
            "POST",
            f"/api/v1/runner/runs/{run_id}/output/",
            json=OutputChunk(offset, text).to_json(),
            allow=(409, 410),
        )
        answer = _answer(OutputAnswer, response)
        if response.status_code == 409:
            raise OutputBehind(answer.size)
        if response.status_code == 410:
            raise OutputClosed(answer.detail)
        return answer.size

    # --- homes (runners/host/serving.py) ---------------------------------------------------

    def take_home(self, operation: str) -> HomeOrder | None:
        """The home operation to carry out; None when it is no longer wanted (its asker gave
        up, or another taking got it)."""
        response = self._request(
            "POST", f"/api/v1/runner/home/{operation}/take/", allow=(404, 409, 410)
        )
        if response.status_code in (404, 409, 410):
            return None
        return _answer(HomeOrder, response)

    def answer_home(self, operation: str, answer: HomeAnswer) -> None:
        """What came of a home operation (a late answer to one given up on is dropped)."""
        self._request(
            "POST",
            f"/api/v1/runner/home/{operation}/answer/",
            json=answer.to_json(),
            allow=(404, 409, 410),
        )

    def send_home(
        self, operation: str, answer: HomeAnswer, chunks: Iterable[bytes], size: int | None
    ) -> None:
        """A streamed answer (a download): ``answer`` in a header, the bytes as the body, with
        a length when it is known beforehand. A file's bytes (``chunks`` with a ``fileno``
        and a length) go by ``sendfile``, never through Python."""
        headers = {
            HOME_ANSWER_HEADER: json.dumps(answer.to_json()),
            "Content-Type": "application/octet-stream",
            # Its own connection, closed after: the body then goes with a 100 Continue from
            # the control plane, which reads it straight from the socket (homes/wire.py).
            "Connection": "close",
        }
        url = f"{self.url}/api/v1/runner/home/{operation}/body/"
        plain = urlsplit(url).scheme == "http"
        if plain:
            headers["Expect"] = "100-continue"
        with self._transfer("PUT", url, headers, size) as connection:
            if not plain or _continued(connection, "PUT", url):  # else refused before the body
                _send_body(connection, url, chunks, size, sendfile=plain)
            _response(connection, "PUT", url, allow=(404, 409, 410))

    @contextmanager
    def home_upload(self, operation: str) -> Iterator[Iterator[bytes]]:
        """An upload's bytes, as they come from the control plane, read a MiB at a time
        straight from the connection."""
        url = f"{self.url}/api/v1/runner/home/{operation}/body/"
        with self._transfer("GET", url, {}, None, body=False) as connection:
            yield _chunks(_response(connection, "GET", url), url)

    @contextmanager
    def _transfer(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        size: int | None,
        *,
        body: bool = True,
    ) -> Iterator[http.client.HTTPConnection]:
        """A connection of its own for a transfer, its request line and headers sent (the
        body is the caller's to send), closed after. httpx moves a body 64 KiB at a time
        through its parser, which cost a runner more than the rest of a transfer together
        (measured); ``http.client`` lets the bytes go by the MiB, or by ``sendfile``."""
        where = urlsplit(url)
        connect = STREAM_TIMEOUT.connect
        connection: http.client.HTTPConnection
        if where.scheme == "https":
            connection = http.client.HTTPSConnection(
                where.hostname or "", where.port, timeout=connect, context=self._tls()
            )
        else:
            connection = http.client.HTTPConnection(
                where.hostname or "", where.port, timeout=connect
            )
        try:
            with _said(method, url):
                connection.connect()
                connection.sock.settimeout(STREAM_TIMEOUT.read)  # connected: now a pause's
                connection.putrequest(method, where.path, skip_accept_encoding=True)
                connection.putheader("Authorization", self._client.headers["Authorization"])
                for name, value in headers.items():
                    connection.putheader(name, value)
                if body:
                    if size is None:
                        connection.putheader("Transfer-Encoding", "chunked")
                    else:
                        connection.putheader("Content-Length", str(size))
                connection.endheaders()
            yield connection
        finally:
            connection.close()

    def _tls(self) -> ssl.SSLContext:
        """What httpx verifies the control plane's certificate with, for a transfer's own
        connection."""
        if self._tls_context is None:
            self._tls_context = httpx.create_ssl_context(trust_env=False)
        return self._tls_context

    def _request(
        self, method: str, path: str, *, allow: tuple[int, ...] = (), **kwargs: Any
    ) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"{method} {self.url}{path}: {exc}") from exc
        if response.status_code >= 400 and response.status_code not in allow:
            raise ControlPlaneError(
                f"{method} {self.url}{path}: {response.status_code} {response.text[:200]}",
                response.status_code,
            )
        return response

    @staticmethod
    def register(url: str, registration_token: str, name: str, labels: Iterable[str]) -> Registered:
        """Register a new runner; returns its id, name, organisation and runner token."""
        asked = Registration(registration_token, name, tuple(labels))
        try:
            response = httpx.post(
                f"{url.rstrip('/')}/api/v1/runners/register/",
                json=asked.to_json(),
                timeout=10,
                trust_env=False,
            )
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"cannot reach {url}: {exc}") from exc
        if response.status_code != 201:
            raise ControlPlaneError(f"registration refused: {response.status_code} {response.text}")
        return _answer(Registered, response)


# A transfer may pause this long between two chunks (a slow disk or client at the other end).
STREAM_TIMEOUT = httpx.Timeout(60.0, connect=5.0)


@runtime_checkable
class Fileno(Protocol):
    """A file's bytes that can be sent without reading them (``socket.sendfile``)."""

    def fileno(self) -> int: ...


def _send_body(
    connection: http.client.HTTPConnection,
    url: str,
    chunks: Iterable[bytes],
    size: int | None,
    *,
    sendfile: bool,
) -> None:
    """A request's body: a file by ``sendfile`` (when allowed: not through TLS), else its
    chunks as they come, framed when no length was said (an empty chunk ends it)."""
    if size and isinstance(chunks, Fileno) and sendfile:
        with os.fdopen(os.dup(chunks.fileno()), "rb", buffering=0) as file:
            with _said("PUT", url):
                sent = connection.sock.sendfile(file, 0, size)
            if sent != size:
                raise ControlPlaneError(f"PUT {url}: the file ended {size - sent} bytes short")
        return
    for data in chunks:  # (what goes wrong reading the home is not the network's)
        if data:
            with _said("PUT", url):
                if size is None:
                    connection.send(b"%x\r\n" % len(data))
                connection.send(data)
                if size is None:
                    connection.send(b"\r\n")
    if size is None:
        with _said("PUT", url):
            connection.send(b"0\r\n\r\n")


INTERIM = (b"HTTP/1.1 100 ", b"HTTP/1.0 100 ")
CONTINUE_SECONDS = 1.0  # how long a body waits for a 100 Continue before it goes anyway


def _continued(connection: http.client.HTTPConnection, method: str, url: str) -> bool:
    """After a request that expects 100 Continue (plain HTTP): True once the server said so
    (the interim answer taken off the connection) or said nothing for CONTINUE_SECONDS (the
    body goes anyway, as RFC 9110 lets a client); False when its final answer came instead
    (left on the connection for getresponse)."""
    sock = connection.sock
    deadline = time.monotonic() + CONTINUE_SECONDS
    with _said(method, url), selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                break
            seen = sock.recv(1024, socket.MSG_PEEK)
            if not seen:
                return False  # closed: getresponse says so
            if not any(seen.startswith(s) or s.startswith(seen) for s in INTERIM):
                return False
            end = seen.find(b"\r\n\r\n")
            if end >= 0:
                sock.recv(end + 4)  # the interim answer, and nothing of what follows
                return True
            time.sleep(0.001)  # the rest of the interim answer is on its way
    return True


@contextmanager
def _said(method: str, url: str) -> Iterator[None]:
    """A transfer's network failure as ControlPlaneError."""
    try:
        yield
    except (OSError, http.client.HTTPException) as exc:
        raise ControlPlaneError(f"{method} {url}: {exc}") from exc


def _response(
    connection: http.client.HTTPConnection, method: str, url: str, *, allow: tuple[int, ...] = ()
) -> http.client.HTTPResponse:
    """The answer to a transfer (its body read, but a GET's); ControlPlaneError when it is a
    refusal not in ``allow``."""
    with _said(method, url):
        response = connection.getresponse()
        refused = response.status != 200 if method == "GET" else response.status >= 400
        if refused and response.status not in allow:
            said = response.read(200).decode(errors="replace")
            raise ControlPlaneError(f"{method} {url}: {response.status} {said}", response.status)
        if method != "GET":
            response.read()
    return response


def _chunks(response: http.client.HTTPResponse, url: str) -> Iterator[bytes]:
    """A response's body a MiB at a time; ControlPlaneError when it ends short of its length."""
    left = response.length
    while True:
        try:
            data = response.read(TRANSFER_CHUNK)
        except (OSError, http.client.HTTPException) as exc:
            raise ControlPlaneError(f"the upload broke off: GET {url}: {exc}") from exc
        if not data:
            break
        if left is not None:
            left -= len(data)
        yield data
    if left:
        raise ControlPlaneError(f"the upload broke off: GET {url}: {left} bytes short")


TRANSFER_CHUNK = 1024 * 1024


def _without_unsaid(message: Message) -> dict[str, Any]:
    """A body without the fields left unsaid (None), as a control plane from before those
    fields reads it."""
    return {name: value for name, value in message.to_json().items() if value is not None}


def _answer[M: Message](kind: type[M], response: httpx.Response) -> M:
    """The control plane's answer as a protocol message; ControlPlaneError when it is not one
    (a runner never acts on half an answer)."""
    try:
        return kind.from_json(response.json())
    except (ValueError, ProtocolError) as exc:  # not JSON, or not this message
        raise ControlPlaneError(
            f"{response.request.method} {response.request.url}: not a {kind.__name__}: {exc}",
            response.status_code,
        ) from None
