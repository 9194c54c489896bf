"""Benchmark the gateway's API route: the time it adds to an API call, against the same call
straight to the API, measured in the same run.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/api_broker.py            # 2,000 calls each way
    .venv/bin/python bench/api_broker.py --quick    # 300

Everything runs on this machine: a stand-in of GitHub's REST API (tests/connections/
githubapi.py, over TLS with a test CA's certificate for 127.0.0.1) in a process of its own, and
the route (connections/apibroker.py, with a broker that knows one run's token and grant) in
another. One client, keeping its connections as SDKs do, calls ``GET /repos/acme/app``
alternately straight (with the connection's token) and through the route (with the run's
token), so that both see the same machine at the same moments. It prints each way's p50 and p90
and the time the route adds at the median (target: at most 3 ms).
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support import (
    Processes,
    free_port,
    percentile,
    run_bench,
    step,
    verdict,
    wait_listening,
)

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "covey-bench-run-token"  # noqa: S105 - the bench's own, on loopback
SECRET = "bench-api-credential"  # noqa: S105 - the stand-in API's


def serve_api(port: int, ca_dir: str) -> None:
    """The stand-in API, in this process until it is stopped."""
    from aiohttp import web
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tests.connections.githubapi import GitHub
    from tests.netfixtures import TestCA

    ca = TestCA(ca_dir)
    github = GitHub(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    github.also.add(SECRET)
    github.seen = _Forgetful()  # a long bench would otherwise keep every request
    app = web.Application()
    github.routes(app)
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=ca.issue("127.0.0.1"), print=None)


class _Forgetful(list[Any]):
    def append(self, item: Any) -> None:
        pass


def serve_route(port: int, api_port: int, ca_file: str) -> None:
    """The API route with a broker that knows the bench's run, in this process."""
    import ssl

    from aiohttp import ClientSession, TCPConnector, web

    from connections.apibroker import ApiRoute
    from connections.broker import GitAccess, NotGranted, Unauthenticated
    from connections.github import InstallationTokens
    from connections.rules import GitGrant, default_push

    grant = GitGrant(repositories=("acme/*",), push=default_push("bench"))
    headers = {"Authorization": f"Bearer {SECRET}"}
    calls = frozenset({"read", "pulls", "comments"})

    class Broker:
        def git_access(self, token: str, host: str, repository: str) -> GitAccess:
            raise NotGranted

        def api_access(self, token: str, host: str, repository: str) -> GitAccess:
            if token != TOKEN:
                raise Unauthenticated
            if host != "api.git.test" or not grant.covers(repository):
                raise NotGranted
            return GitAccess(1, f"https://127.0.0.1:{api_port}", headers, grant, api=calls)

        def registry_access(self, token: str, name: str) -> Any:
            raise NotGranted

        def record(self, token: str, event: Any) -> None:
            pass

    sessions: list[ClientSession] = []

    async def start(app: web.Application) -> None:
        context = ssl.create_default_context(cafile=ca_file)
        sessions.append(ClientSession(connector=TCPConnector(ssl=context, limit=0)))

    route = ApiRoute(Broker(), lambda: sessions[0], InstallationTokens(lambda: sessions[0]))
    app = web.Application()
    app.on_startup.append(start)
    app.router.add_route("*", "/api/{tail:.*}", route.handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def bench(work: Path, processes: Processes, calls: int) -> dict[str, Any]:
    api_port, route_port = free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    python_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    api = processes.start("api", [*me, "--serve-api", str(api_port), str(work)], python_env)
    wait_listening(processes, api, "api", api_port, "the stand-in API listening")
    ca_file = str(work / "ca.pem")
    route = processes.start(
        "route", [*me, "--serve-route", str(route_port), str(api_port), ca_file], python_env
    )
    wait_listening(processes, route, "route", route_port, "the API route listening")

    straight = httpx.Client(
        base_url=f"https://127.0.0.1:{api_port}",
        verify=ca_file,
        headers={"Authorization": f"Bearer {SECRET}"},
    )
    through = httpx.Client(
        base_url=f"http://127.0.0.1:{route_port}/api/api.git.test",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    times: dict[str, list[float]] = {"straight": [], "through": []}
    with straight, through:
        step(f"{calls} calls each way, alternately (after 50 to warm up)")
        for number in range(calls + 50):
            for name, client in (("straight", straight), ("through", through)):
                began = time.perf_counter()
                answer = client.get("/repos/acme/app")
                took = time.perf_counter() - began
                if answer.status_code != 200:
                    raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:200]}")
                if number >= 50:
                    times[name].append(took * 1000)
    return {
        name: (percentile(values, 50), percentile(values, 90)) for name, values in times.items()
    } | {"calls": calls}


def report(figures: dict[str, Any]) -> None:
    (s50, s90), (t50, t90) = figures["straight"], figures["through"]
    added = t50 - s50
    print()
    print("| measure | straight | through the route | added | target |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| GET /repos/acme/app, p50 of {figures['calls']} | {s50:.2f} ms | {t50:.2f} ms"
        f" | {added:+.2f} ms | ≤ 3 ms: {verdict(added <= 3)} |"
    )
    print(f"| the same, p90 | {s90:.2f} ms | {t90:.2f} ms | {t90 - s90:+.2f} ms | |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 calls each way")
    parser.add_argument("--serve-api", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve-route", nargs=3, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_api:
        port, ca_dir = arguments.serve_api
        serve_api(int(port), ca_dir)
        return 0
    if arguments.serve_route:
        port, api_port, ca_file = arguments.serve_route
        serve_route(int(port), int(api_port), ca_file)
        return 0
    figures: dict[str, Any] = {}

    def body(work: Path, processes: Processes, stack: Any) -> None:
        figures.update(bench(work, processes, 300 if arguments.quick else 2000))

    failed = run_bench("covey-bench-api-", 600, body)
    if "through" in figures:
        report(figures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
