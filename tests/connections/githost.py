"""A stand-in git host for the broker's tests: ``git http-backend`` behind a small TLS server
on loopback (a certificate from the test's CA), holding bare repositories that answer only to
one credential (HTTP basic, as GitHub takes an installation token), and remembering every
request's path and headers."""

import asyncio
import base64
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.connections.gitenv import git_env


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class GitHost:
    """Bare repositories under ``root`` (``owner/name.git``), served to ``credential``."""

    root: Path
    credential: str = field(repr=False)
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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request, through ``git http-backend`` as CGI, both ways streamed (a large clone
        or push holds no more than a chunk of it here)."""
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers)))
        if not self.accepts(request.headers.get("Authorization")):
            return web.Response(status=401, headers={"WWW-Authenticate": 'Basic realm="git"'})
        env = {
            **git_env(self.root),
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REMOTE_USER": "x-access-token",
            "REQUEST_METHOD": request.method,
            "PATH_INFO": request.path,
            "QUERY_STRING": request.query_string,
            "CONTENT_TYPE": request.headers.get("Content-Type", ""),
            "GIT_PROTOCOL": request.headers.get("Git-Protocol", ""),
            "HTTP_CONTENT_ENCODING": request.headers.get("Content-Encoding", ""),
        }
        if request.content_length is not None:
            env["CONTENT_LENGTH"] = str(request.content_length)
        process = await asyncio.create_subprocess_exec(
            "git", "http-backend", env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert process.stdin is not None and process.stdout is not None
        feeding = asyncio.ensure_future(_feed(request, process.stdin))
        status, headers = 200, {}
        while (line := (await process.stdout.readline()).rstrip(b"\r\n")) != b"":
            name, _, value = line.decode().partition(": ")
            if name.lower() == "status":
                status = int(value.split()[0])
            else:
                headers[name] = value
        answer = web.StreamResponse(status=status, headers=headers)
        await answer.prepare(request)
        try:
            while chunk := await process.stdout.read(65536):
                await answer.write(chunk)
        except ConnectionResetError:  # the client read what it wanted (a default branch)
            process.kill()
            feeding.cancel()
            await process.wait()
            return answer
        await feeding
        await process.wait()
        await answer.write_eof()
        return answer


def _basic(token: str) -> str:
    return "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()


async def _feed(request: web.Request, stdin: asyncio.StreamWriter) -> None:
    async for chunk in request.content.iter_chunked(65536):
        stdin.write(chunk)
        await stdin.drain()
    stdin.close()


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
