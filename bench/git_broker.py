"""Benchmark the gateway's git route: a clone and a push through it against the same straight
from the host, and the route's memory while a large push passes.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/git_broker.py            # 100 MiB clone and push, a 1 GiB push
    .venv/bin/python bench/git_broker.py --quick    # 32 MiB, and a 256 MiB push

Everything runs on this machine: a stand-in git host (tests/connections/githost.py: git
http-backend over TLS, a test CA's certificate for 127.0.0.1, one credential) in a process of
its own, and the route (connections/broker.py, with a broker that knows one run's token and
grant) in another. In the same run it measures, with the real git client:

1. a clone of a repository holding one commit of random data (incompressible), straight from
   the host (the baseline, with the host's credential) and through the route (with the run's
   token): the throughput of each and their ratio (target: at least 0.8);
2. a push of a new commit of the same size to a branch the grant allows, straight and through
   the route, each into a repository of its own: the ratio (target: at least 0.8);
3. the route process's resident memory while a larger push passes through it, sampled every
   50 ms: its growth over what it held before (target: under 64 MiB).
"""

import argparse
import base64
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support import (
    BenchError,
    Processes,
    free_port,
    ratio,
    run_bench,
    step,
    verdict,
    wait_listening,
)

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "covey-bench-run-token"  # noqa: S105 - the bench's own, on loopback
SECRET = "bench-host-credential"  # noqa: S105 - the stand-in host's
MIB = 1024 * 1024


def serve_host(root: str, port: int, ca_dir: str) -> None:
    """The stand-in host, in this process until it is stopped."""
    from aiohttp import web

    from tests.connections.githost import GitHost
    from tests.netfixtures import TestCA

    ca = TestCA(ca_dir)
    host = GitHost(Path(root), SECRET)
    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", host.handle)
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=ca.issue("127.0.0.1"), print=None)


def serve_route(port: int, host_port: int, ca_file: str) -> None:
    """The git route with a broker that knows the bench's run, in this process."""
    import ssl

    from aiohttp import ClientSession, TCPConnector, web

    from connections.broker import GitAccess, GitRoute, NotGranted, Unauthenticated
    from connections.github import InstallationTokens
    from connections.rules import GitGrant, default_push
    from tests.connections.githost import GitHost

    grant = GitGrant(repositories=("acme/*",), push=default_push("bench"))
    header = {"Authorization": GitHost(Path("."), SECRET).authorization}

    class Broker:
        def git_access(self, token: str, host: str, repository: str) -> GitAccess:
            if token != TOKEN:
                raise Unauthenticated
            if host != "git.test" or not grant.covers(repository):
                raise NotGranted
            return GitAccess(1, f"https://127.0.0.1:{host_port}", header, grant)

        def api_access(self, token: str, host: str, repository: str) -> GitAccess:
            raise NotGranted

        def registry_access(self, token: str, name: str) -> Any:
            raise NotGranted

        def record(self, token: str, event: Any) -> None:
            pass

    sessions: list[ClientSession] = []

    async def start(app: web.Application) -> None:
        context = ssl.create_default_context(cafile=ca_file)
        sessions.append(ClientSession(connector=TCPConnector(ssl=context)))

    route = GitRoute(
        Broker(),
        lambda: sessions[0],
        InstallationTokens(lambda: sessions[0]),
        max_push_bytes=4 * 1024 * MIB,
    )
    app = web.Application(client_max_size=0)
    app.on_startup.append(start)
    app.router.add_route("*", "/git/{tail:.*}", route.handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def git(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Seconds ``git args`` took; BenchError when it failed."""
    began = time.perf_counter()
    result = subprocess.run(  # noqa: S603 - git, with the bench's own arguments
        ["git", *args],  # noqa: S607 - the git on PATH, as a user's
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - began
    if result.returncode != 0:
        raise BenchError(f"git {' '.join(args[:3])} failed: {result.stderr[-600:]}")
    return took


def environment(home: Path) -> dict[str, str]:
    from tests.connections.gitenv import git_env

    return git_env(home)


def seed(root: Path, name: str, size: int, env: dict[str, str]) -> None:
    """A bare repository acme/<name>.git holding one commit of ``size`` random bytes."""
    bare = root / "acme" / f"{name}.git"
    work = root / "seeds" / name
    git(["init", "-q", "--bare", "--initial-branch=main", str(bare)], root, env)
    git(["init", "-q", "--initial-branch=main", str(work)], root, env)
    random_file(work / "data.bin", size)
    git(["add", "data.bin"], work, env)
    git(["commit", "-q", "-m", "data"], work, env)
    git(["push", "-q", str(bare), "main"], work, env)


def random_file(path: Path, size: int) -> None:
    """``size`` random bytes (incompressible, as a pack of them stays), written in pieces."""
    with path.open("wb") as out:
        for start in range(0, size, 16 * MIB):
            out.write(os.urandom(min(16 * MIB, size - start)))


def new_commit(work: Path, size: int, label: str, env: dict[str, str]) -> None:
    random_file(work / f"{label}.bin", size)
    git(["add", f"{label}.bin"], work, env)
    git(["commit", "-q", "-m", label], work, env)


class Sampler:
    """The largest resident size of a process, sampled every 50 ms while it runs."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> "Sampler":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def bench(work: Path, processes: Processes, size: int, large: int) -> dict[str, Any]:
    env = environment(work)
    root = work / "host"
    root.mkdir()
    step(f"seeding repositories of {size // MIB} MiB")
    for name in ("app", "straight", "through"):
        seed(root, name, size, env)
    host_port, route_port = free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    python_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    host = processes.start(
        "host", [*me, "--serve-host", str(root), str(host_port), str(work)], python_env
    )
    wait_listening(processes, host, "host", host_port, "the stand-in host listening")
    ca_file = str(work / "ca.pem")
    route = processes.start(
        "route", [*me, "--serve-route", str(route_port), str(host_port), ca_file], python_env
    )
    wait_listening(processes, route, "route", route_port, "the git route listening")

    straight_env = {
        **env,
        "GIT_SSL_CAINFO": ca_file,
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "http.extraHeader",
        "GIT_CONFIG_VALUE_0": "Authorization: Basic "
        + base64.b64encode(f"x-access-token:{SECRET}".encode()).decode(),
    }
    through_env = {
        **env,
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "http.extraHeader",
        "GIT_CONFIG_VALUE_0": f"Authorization: Bearer {TOKEN}",
    }
    straight_url = f"https://127.0.0.1:{host_port}/acme"
    through_url = f"http://127.0.0.1:{route_port}/git/git.test/acme"
    figures: dict[str, Any] = {"size_mib": size // MIB, "large_mib": large // MIB}

    step("clone, straight and through the route")
    clone_straight = git(["clone", "-q", f"{straight_url}/app.git", "c1"], work, straight_env)
    clone_through = git(["clone", "-q", f"{through_url}/app.git", "c2"], work, through_env)
    figures["clone"] = (size / clone_straight / MIB, size / clone_through / MIB)

    step("push, straight and through the route")
    for name, url, push_env in (
        ("straight", straight_url, straight_env),
        ("through", through_url, through_env),
    ):
        git(["clone", "-q", f"{url}/{name}.git", f"p-{name}"], work, push_env)
        new_commit(work / f"p-{name}", size, "pushed", env)
    push_straight = git(
        ["push", "-q", "origin", "HEAD:refs/heads/covey/bench/a"], work / "p-straight", straight_env
    )
    push_through = git(
        ["push", "-q", "origin", "HEAD:refs/heads/covey/bench/a"], work / "p-through", through_env
    )
    figures["push"] = (size / push_straight / MIB, size / push_through / MIB)

    step(f"a push of {large // MIB} MiB through the route, its memory sampled")
    new_commit(work / "p-through", large, "large", env)
    before = psutil.Process(route.pid).memory_info().rss
    with Sampler(route.pid) as sampler:
        git(
            ["push", "-q", "origin", "HEAD:refs/heads/covey/bench/b"],
            work / "p-through",
            through_env,
        )
    figures["memory"] = (before / MIB, (sampler.peak - before) / MIB)
    return figures


def report(figures: dict[str, Any]) -> None:
    size = figures["size_mib"]
    print()
    print("| measure | straight | through the route | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    for key, what in (("clone", "clone"), ("push", "push")):
        straight, through = figures[key]
        met = verdict(through / straight >= 0.8)
        print(
            f"| {what} of {size} MiB | {straight:.0f} MiB/s | {through:.0f} MiB/s"
            f" | {ratio(through, straight)} | ≥ 0.8: {met} |"
        )
    held, growth = figures["memory"]
    print(
        f"| route memory during a {figures['large_mib']} MiB push | | {held:.0f} MiB held,"
        f" +{growth:.1f} MiB at most | | < 64 MiB: {verdict(growth < 64)} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB, and a 256 MiB push")
    parser.add_argument("--serve-host", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--serve-route", nargs=3, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_host:
        root, port, ca_dir = arguments.serve_host
        serve_host(root, int(port), ca_dir)
        return 0
    if arguments.serve_route:
        port, host_port, ca_file = arguments.serve_route
        serve_route(int(port), int(host_port), ca_file)
        return 0
    size, large = (32 * MIB, 256 * MIB) if arguments.quick else (100 * MIB, 1024 * MIB)
    figures: dict[str, Any] = {}

    def body(work: Path, processes: Processes, stack: Any) -> None:
        figures.update(bench(work, processes, size, large))

    failed = run_bench("covey-bench-git-", 900, body)
    if "memory" in figures:
        report(figures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
