"""How a proxy on a runner host reaches the control plane: policy and decisions over HTTP with
the runner's token (no Django: it runs in the egress image, with no database).

The token comes from ``COVEY_RUNNER_TOKEN`` or from the runner's file (``runner_register``
writes it; every token renewal rewrites it), which is re-read whenever it changes, so a proxy
follows its runner's renewed token without a restart.
"""

import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from egress.environment import DESK_TOKEN_HEADER as TOKEN_HEADER
from egress.protocol import DecisionBatch, PolicySnapshot, ProxyEvent
from egress.proxy.config import ProxyConfig
from egress.proxy.feed import Refused


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
    """The policy source and decision sink of a proxy on a runner host."""

    def __init__(self, url: str, token: Callable[[], str], *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._client = httpx.Client(
            base_url=self.url,
            timeout=timeout,
            trust_env=False,  # never through a proxy
        )

    def __call__(self, known_generation: str | None) -> PolicySnapshot | None:
        """The runner's organisation's egress policy; None when it has not changed. A body
        that is not a snapshot raises ProtocolError (the feed keeps its last good policy)."""
        headers = self._headers()
        if known_generation:
            headers["If-None-Match"] = f'"{known_generation}"'
        response = self._client.get("/api/v1/egress/policy/", headers=headers)
        if response.status_code == 304:
            return None
        response.raise_for_status()
        return PolicySnapshot.from_json(response.json())

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
