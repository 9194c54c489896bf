"""A runner's identity on its host: the file runner_register (or the control plane, for a
built-in runner) writes, with its id, name, installation key and token, and the names it goes
by on the Docker engine."""

import json
import os
import threading
from pathlib import Path

from runners.host.client import ControlPlaneClient


class Identity:
    """One runner this host serves: its id, name and token, kept in a JSON file (mode 0600)
    that token renewals rewrite. The control plane's URL is the file's (runner_register writes
    it) unless given."""

    def __init__(self, path: Path, url: str | None = None) -> None:
        self.path = path
        data = json.loads(path.read_text())
        self.url = url or str(data["url"])
        self.id = int(data["id"])
        self.name = str(data.get("name", data["id"]))
        self._installation = str(data.get("installation") or "")
        self._token = str(data["token"])
        self._mtime = path.stat().st_mtime_ns
        self._client = ControlPlaneClient(self.url, self._token)
        self._lock = threading.Lock()

    @property
    def token(self) -> str:
        """The current token (re-read when the control plane rewrote the file)."""
        self._refresh()
        return self._token

    @property
    def installation(self) -> str:
        """The key of the installation this runner belongs to (asked for once when its file,
        written by an older covey, does not have it)."""
        if not self._installation:
            self._installation = self.client.me().installation
        return self._installation

    @property
    def client(self) -> ControlPlaneClient:
        """A client that uses the current token."""
        self._refresh()
        return self._client

    def _refresh(self) -> None:
        with self._lock:
            mtime = self.path.stat().st_mtime_ns
            if mtime != self._mtime:
                self._token = str(json.loads(self.path.read_text())["token"])
                self._mtime = mtime
                self._client.set_token(self._token)

    def replace_token(self, token: str) -> None:
        """Keep a renewed token: in the file first (atomically), then in use."""
        with self._lock:
            data = json.loads(self.path.read_text())
            data["token"] = token
            temporary = self.path.with_name(self.path.name + ".tmp")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            with open(os.open(temporary, flags, 0o600), "w") as file:
                json.dump(data, file, indent=2)
            temporary.replace(self.path)
            self._token = token
            self._mtime = self.path.stat().st_mtime_ns
            self._client.set_token(token)


def runner_name(identity: Identity) -> str:
    """The runner's name on the Docker engine: its containers' label, its isolation's names."""
    return docker_name(identity.id, identity.installation)


def docker_name(runner_id: int, installation: str) -> str:
    """A runner's name on a Docker engine, unique across the installations sharing it."""
    return f"runner-{runner_id}-{installation}"
