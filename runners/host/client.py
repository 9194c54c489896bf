"""The one module a runner uses to speak HTTP to the control plane (with its runner token)."""

import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from runners.protocol import (
    FEATURES,
    HOME_ANSWER_HEADER,
    MAX_PROBLEM_CHARS,
    OUTPUT_TOTAL_HEADER,
    ActiveRun,
    ActiveRuns,
    HomeAnswer,
    HomeOrder,
    LaunchSpec,
    Message,
    OutputAnswer,
    OutputChunk,
    ProbePlan,
    ProbeStatusAnswer,
    ProtocolError,
    RunnerInfo,
    RunReport,
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

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def set_token(self, token: str) -> None:
        """Use a renewed runner token from now on."""
        self._client.headers["Authorization"] = f"Runner {token}"

    def me(self) -> RunnerInfo:
        """Who this runner is (id, name, organisation, labels, paused, queue)."""
        return _answer(RunnerInfo, self._request("GET", "/api/v1/runner/"))

    def heartbeat(self, isolation: str = "", problem: str | None = None) -> RunnerInfo:
        """Tell the control plane this runner is alive, what it enforces (network or
        cooperative) and whether it can take work (``problem``: '' when it can, else why
        not; None: not said); answers like :meth:`me`."""
        body: dict[str, Any] = {"isolation": isolation} if isolation else {}
        if problem is not None:
            body["ready"] = not problem
            body["problem"] = problem[:MAX_PROBLEM_CHARS]
        return _answer(RunnerInfo, self._request("POST", "/api/v1/runner/", json=body))

    def begin_probe(
        self, probe_id: str | None, isolation: str, reason: str = ""
    ) -> ProbePlan | None:
        """What an egress probe is to try (a new one when ``probe_id`` is None); None when the
        ordered probe is no longer this runner's to run."""
        body = {"probe": probe_id, "isolation": isolation, "reason": reason}
        response = self._request("POST", "/api/v1/runner/probes/", json=body, allow=(409,))
        if response.status_code == 409:
            return None
        return _answer(ProbePlan, response)

    def report_probe(
        self, probe_id: str, checks: list[dict[str, str]], detail: str = ""
    ) -> ProbeStatusAnswer:
        """What the probe saw, one entry per check (or why it could not run)."""
        response = self._request(
            "POST",
            f"/api/v1/runner/probes/{probe_id}/report/",
            json={"checks": checks, "detail": detail},
        )
        return _answer(ProbeStatusAnswer, response)

    def pause(self, paused: bool) -> RunnerInfo:
        response = self._request("POST", "/api/v1/runner/pause/", json={"paused": paused})
        return _answer(RunnerInfo, response)

    def active_runs(self) -> tuple[ActiveRun, ...]:
        """The runs the control plane expects this runner to have a sandbox for."""
        return _answer(ActiveRuns, self._request("GET", "/api/v1/runner/runs/")).runs

    def start_run(self, run_id: str) -> LaunchSpec | None:
        """The sandbox spec of a run this runner is to start; None when it no longer is."""
        response = self._request(
            "POST",
            f"/api/v1/runner/runs/{run_id}/start/",
            json={"features": list(FEATURES)},
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
        a length when it is known beforehand."""
        headers = {
            HOME_ANSWER_HEADER: json.dumps(answer.to_json()),
            "Content-Type": "application/octet-stream",
        }
        if size is not None:
            headers["Content-Length"] = str(size)
        self._request(
            "PUT",
            f"/api/v1/runner/home/{operation}/body/",
            content=chunks,
            headers=headers,
            timeout=STREAM_TIMEOUT,
            allow=(404, 409, 410),
        )

    @contextmanager
    def home_upload(self, operation: str) -> Iterator[Iterator[bytes]]:
        """An upload's bytes, as they come from the control plane."""
        path = f"/api/v1/runner/home/{operation}/body/"
        try:
            with self._client.stream("GET", path, timeout=STREAM_TIMEOUT) as response:
                if response.status_code != 200:
                    response.read()
                    raise ControlPlaneError(
                        f"GET {self.url}{path}: {response.status_code} {response.text[:200]}",
                        response.status_code,
                    )
                yield _chunks(response)
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"GET {self.url}{path}: {exc}") from exc

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
    def register(
        url: str, registration_token: str, name: str, labels: Iterable[str]
    ) -> Mapping[str, Any]:
        """Register a new runner; returns its id, name, organisation and runner token."""
        try:
            response = httpx.post(
                f"{url.rstrip('/')}/api/v1/runners/register/",
                json={
                    "registration_token": registration_token,
                    "name": name,
                    "labels": list(labels),
                },
                timeout=10,
                trust_env=False,
            )
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"cannot reach {url}: {exc}") from exc
        if response.status_code != 201:
            raise ControlPlaneError(f"registration refused: {response.status_code} {response.text}")
        data: Mapping[str, Any] = response.json()
        return data


# A transfer may pause this long between two chunks (a slow disk or client at the other end).
STREAM_TIMEOUT = httpx.Timeout(60.0, connect=5.0)


def _chunks(response: httpx.Response) -> Iterator[bytes]:
    try:
        yield from response.iter_raw()  # as they come: a set size is slower (measured)
    except httpx.HTTPError as exc:
        raise ControlPlaneError(f"the upload broke off: {exc}") from exc


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
