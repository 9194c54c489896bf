"""How a proxy on a runner host reaches the control plane: policy (polled, or followed on the
policy stream the control plane names) and decisions over HTTP with the runner's token (no
Django: it runs in the egress image, with no database).

The token comes from ``COVEY_RUNNER_TOKEN`` or from the runner's file (``runner_register``
writes it; every token renewal rewrites it), which is re-read whenever it changes, so a proxy
follows its runner's renewed token without a restart.
"""

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from egress.environment import DESK_TOKEN_HEADER as TOKEN_HEADER
from egress.protocol import (
    POLICY_FORM,
    STREAM_HEADER,
    STREAM_KEEPALIVE,
    DecisionBatch,
    PolicySnapshot,
    ProxyEvent,
    StreamLine,
    stream_line_from_json,
)
from egress.proxy.config import ProxyConfig
from egress.proxy.feed import Refused

logger = logging.getLogger(__name__)

SYNC_SECONDS = 2.0  # a look-up waits this long at most (egress.proxy.addon's LOOKUP_SECONDS)


class RunnerFile:
    """The runner's file: the control plane's URL and the current runner token."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._mtime = -1
        self._data: Mapping[str, Any] = {}
        self._read()

    @property
    def url(self) -> str:
        return str(self._read()["url"])

    def token(self) -> str:
        """The token in the file now."""
        return str(self._read()["token"])

    def _read(self) -> Mapping[str, Any]:
        with self._lock:
            mtime = self.path.stat().st_mtime_ns
            if mtime != self._mtime:
                data = json.loads(self.path.read_text())
                if not isinstance(data, dict) or "token" not in data or "url" not in data:
                    raise ValueError(f"{self.path} has no url and token")
                self._data, self._mtime = data, mtime
            return self._data


class ControlPlaneSource:
    """The policy source, policy stream and decision sink of a proxy on a runner host."""

    def __init__(self, url: str, token: Callable[[], str], *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._client = httpx.Client(
            base_url=self.url,
            timeout=timeout,
            trust_env=False,  # never through a proxy
        )
        # A stream is silent at most STREAM_KEEPALIVE seconds; one silent for longer is lost.
        self._stream_client = httpx.Client(
            timeout=httpx.Timeout(timeout, read=2 * STREAM_KEEPALIVE + 2), trust_env=False
        )
        self.stream_url: str | None = None  # as the control plane's last answer named it
        self._refused_stream = ""
        self._following: httpx.Response | None = None

    def __call__(self, known_generation: str | None) -> PolicySnapshot | None:
        """The runner's organisation's egress policy; None when it has not changed. A body
        that is not a snapshot raises ProtocolError (the feed keeps its last good policy).
        The answer also says where the policy stream is, if anywhere."""
        headers = self._headers()
        if known_generation:
            headers["If-None-Match"] = f'"{known_generation}"'
        response = self._client.get(
            "/api/v1/egress/policy/", params={"v": POLICY_FORM}, headers=headers
        )
        if response.status_code == 304:
            self.stream_url = self._stream_url(response)
            return None
        response.raise_for_status()
        snapshot = PolicySnapshot.from_json(response.json())
        self.stream_url = self._stream_url(response)
        return snapshot

    def _stream_url(self, response: httpx.Response) -> str | None:
        """The stream the control plane names, if it names an HTTP URL; never plain HTTP when
        the control plane is reached over HTTPS (the runner's token would go in the clear)."""
        url = response.headers.get(STREAM_HEADER, "").strip()
        if not url:
            return None
        try:
            scheme = httpx.URL(url).scheme
        except httpx.InvalidURL:
            scheme = ""
        if scheme not in ("http", "https"):
            problem = "is no http(s) URL"
        elif scheme == "http" and httpx.URL(self.url).scheme == "https":
            problem = "is plain HTTP, and the control plane is reached over HTTPS"
        else:
            return url
        if url != self._refused_stream:  # said once per URL, not at every poll
            self._refused_stream = url
            logger.warning("covey: not following the policy stream %r: it %s", url, problem)
        return None

    def follow(self, known_generation: str | None) -> Iterator[StreamLine] | None:
        """The policy stream's lines from ``known_generation`` on (egress/stream/); None
        when the control plane named no stream. Raises when the stream refuses or fails."""
        url = self.stream_url
        if url is None:
            return None
        return self._lines(url, known_generation)

    def _lines(self, url: str, known_generation: str | None) -> Iterator[StreamLine]:
        headers = self._headers()
        if known_generation:
            headers["If-None-Match"] = f'"{known_generation}"'
        params = {"v": POLICY_FORM}
        with self._stream_client.stream("GET", url, params=params, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                raise OSError(
                    f"the policy stream answered {response.status_code}: {response.text[:200]}"
                )
            self._following = response
            try:
                for line in response.iter_lines():
                    if line:
                        yield stream_line_from_json(json.loads(line))
            finally:
                self._following = None

    def sync(self) -> str:
        """The generation of the stream that holds every change committed before this call
        (the stream's barrier, ``…/stream/sync/``). Raises when it cannot say."""
        url = self.stream_url
        if url is None:
            raise OSError("no policy stream")
        response = self._stream_client.get(
            url.rstrip("/") + "/sync/", headers=self._headers(), timeout=SYNC_SECONDS
        )
        response.raise_for_status()
        generation = response.json().get("generation")
        if not isinstance(generation, str):
            raise ValueError(f"the stream's barrier answered no generation: {response.text[:200]}")
        return generation

    def interrupt(self) -> None:
        """End the stream being followed (from another thread): its socket is shut, and the
        read in progress returns."""
        response = self._following
        if response is None:
            return
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def post_decisions(self, events: list[ProxyEvent]) -> None:
        """Send a batch of decision events to the control plane's log (:class:`Refused`: it
        answered 400, they are malformed to it, and sending them again would not help)."""
        response = self._client.post(
            "/api/v1/egress/decisions/",
            json=DecisionBatch(tuple(events)).to_json(),
            headers=self._headers(),
        )
        if response.status_code == 400:
            raise Refused(f"400 {response.text[:300]}")
        response.raise_for_status()

    def file_request(
        self, token_sha256: str, filing: Mapping[str, Any]
    ) -> tuple[int, Mapping[str, Any]]:
        """Pass a sandbox's request on (the desk, egress/proxy/desk.py): status and answer."""
        return self._desk("POST", "/api/v1/runner/requests/", token_sha256, json=dict(filing))

    def request_status(self, token_sha256: str, request_id: int) -> tuple[int, Mapping[str, Any]]:
        return self._desk("GET", f"/api/v1/runner/requests/{request_id}/", token_sha256)

    def _desk(
        self, method: str, path: str, token_sha256: str, **kwargs: Any
    ) -> tuple[int, Mapping[str, Any]]:
        try:
            headers = {**self._headers(), TOKEN_HEADER: token_sha256}
            response = self._client.request(method, path, headers=headers, **kwargs)
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: the runner's file
            raise OSError(str(exc)) from exc
        try:
            data = response.json()
        except ValueError:
            data = {"detail": response.text[:500]}
        return response.status_code, data if isinstance(data, dict) else {"detail": str(data)}

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Runner {self._token()}"}


def remote_source(
    config: ProxyConfig, url: str | None, token: str | None, runner_config: str | None
) -> ControlPlaneSource:
    """The control plane as the proxy's policy source, from the flags or the environment."""
    if runner_config:
        try:
            runner_file = RunnerFile(Path(runner_config))
            return ControlPlaneSource(url or runner_file.url, runner_file.token)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {runner_config}: {exc}") from None
    token = token or config.runner_token
    url = url or config.control_plane_url
    if not url or not token:
        raise ValueError(
            "give the control plane (--control-plane or COVEY_CONTROL_PLANE_URL) and a runner"
            " token (--runner-token or COVEY_RUNNER_TOKEN), or --runner-config"
        )
    return ControlPlaneSource(url, lambda: token)
