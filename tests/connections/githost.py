"""A stand-in git host for the broker's tests: the demo forge (connections/forge.py, ``git
http-backend`` behind a small TLS server) on loopback with a certificate from the test's CA,
remembering every request's path and headers, and taking a stand-in GitHub App's tokens too."""

import asyncio
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import encode_basic_auth, web

from connections.forge import Forge
from tests.connections.gitenv import git_env


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class GitHost(Forge):
    """Bare repositories under ``root`` (``owner/name.git``), served to ``credential`` (and to
    tokens a stand-in GitHub App minted)."""

    seen: list[Seen] = field(default_factory=list)
    minted: list[str] = field(default_factory=list, repr=False)  # a GitHub App's tokens, too

    @property
    def authorization(self) -> str:
        return _basic(self.credential)

    def accepts(self, authorization: str | None) -> bool:
        return authorization in {self.authorization, *map(_basic, self.minted)}

    def repository(self, owner_name: str, *, branch: str = "main") -> Path:
        """A bare repository with one commit on ``branch`` (its default)."""
        bare = self.root / f"{owner_name}.git"
        bare.parent.mkdir(parents=True, exist_ok=True)
        work = self.root / "seed" / owner_name
        run(["git", "init", "-q", "--bare", f"--initial-branch={branch}", str(bare)], self.root)
        run(["git", "init", "-q", f"--initial-branch={branch}", str(work)], self.root)
        (work / "README").write_text(f"{owner_name}\n")
        run(["git", "add", "README"], work)
        run(["git", "commit", "-q", "-m", "first"], work)
        run(["git", "push", "-q", str(bare), branch], work)
        return bare

    def ref(self, owner_name: str, ref: str) -> str:
        bare = self.root / f"{owner_name}.git"
        result = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", ref],
            cwd=bare, env=git_env(self.root), capture_output=True, text=True, check=False,
        )  # fmt: skip
        return result.stdout.strip()

    def environment(self) -> dict[str, str]:
        return git_env(self.root)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request, remembered, then served as the forge serves it."""
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers)))
        return await super().handle(request)


def _basic(token: str) -> str:
    return encode_basic_auth("x-access-token", token)


def run(args: list[str], cwd: Path) -> None:
    subprocess.run(args, cwd=cwd, env=git_env(cwd), check=True, capture_output=True)


class Servers:
    """aiohttp applications served on loopback from an event loop in a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def call(self, make: Callable[[], Any]) -> Any:
        """Run a coroutine made by ``make`` on the servers' loop; its result."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)

    def serve(self, app: web.Application, ssl_context: Any = None) -> int:
        async def start() -> int:
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
            await site.start()
            self.runners.append(runner)
            return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        port: int = self.call(start)
        return port

    def close(self) -> None:
        async def stop() -> None:
            for runner in self.runners:
                await runner.cleanup()

        self.call(stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
