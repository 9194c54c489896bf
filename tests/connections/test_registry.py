"""The gateway's registry route before a stand-in private index (TLS with a test CA): reads
under the connection's paths pass with its user name and password in place of the run's token
(sent as pip sends an index URL's credential, or as a bearer token); writes, other paths,
other registries and hostile requests are refused in JSON, before the index sees anything."""

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import ClientSession, TCPConnector, encode_basic_auth, web

from connections.broker import GitAccess, GitEvent, NotGranted, RegistryAccess, Unauthenticated
from connections.registry import RegistryRoute
from tests.connections.githost import Servers
from tests.connections.registryhost import PROJECT, WHEEL, Index
from tests.connections.test_broker import raw
from tests.netfixtures import TestCA

RUN_TOKEN = "covey-run-token-of-the-registry-test"
USER, PASSWORD = "deploy", "the-index-password"


class FakeBroker:
    """One run's token and one registry, ``index``, for /simple/ and /packages/."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.events: list[GitEvent] = []

    def git_access(self, token: str, host: str, repository: str) -> GitAccess:
        raise NotGranted

    def api_access(self, token: str, host: str, repository: str) -> GitAccess:
        raise NotGranted

    def registry_access(self, token: str, name: str) -> RegistryAccess:
        if token != RUN_TOKEN:
            raise Unauthenticated
        if name != "index":
            raise NotGranted
        headers = {"Authorization": encode_basic_auth(USER, PASSWORD)}
        return RegistryAccess(
            1, f"https://127.0.0.1:{self.port}", headers, ("/simple/", "/packages/")
        )

    def record(self, token: str, event: GitEvent) -> None:
        self.events.append(event)


@dataclass
class World:
    index: Index
    broker: FakeBroker
    url: str  # /registry at the gateway


@pytest.fixture
def world(tmp_path) -> Iterator[World]:
    ca = TestCA(tmp_path)
    index = Index(USER, PASSWORD)
    servers = Servers()
    session: list[ClientSession] = []
    try:
        upstream = web.Application()
        index.routes(upstream)
        broker = FakeBroker(servers.serve(upstream, ca.issue("127.0.0.1")))

        async def make_session() -> None:
            session.append(ClientSession(connector=TCPConnector(ssl=ca.client_context())))

        servers.call(make_session)
        route = RegistryRoute(broker, lambda: session[0])
        gateway = web.Application()
        gateway.router.add_route("*", "/registry/{tail:.*}", route.handle)
        port = servers.serve(gateway)
        yield World(index, broker, f"http://127.0.0.1:{port}/registry")

        async def close_session() -> None:
            await session[0].close()

        servers.call(close_session)
    finally:
        servers.close()


def test_reads_pass_with_the_connection_s_credential_in_place_of_the_run_s_token(world):
    page = httpx.get(f"{world.url}/index/simple/{PROJECT}/", auth=("covey", RUN_TOKEN))
    assert page.status_code == 200 and f"../../packages/{WHEEL}" in page.text
    got = httpx.get(
        f"{world.url}/index/packages/{WHEEL}",
        headers={"Authorization": f"Bearer {RUN_TOKEN}", "Cookie": "c=1"},
    )
    assert got.status_code == 200 and got.content == world.index.built
    head = httpx.head(f"{world.url}/index/packages/{WHEEL}", auth=("covey", RUN_TOKEN))
    assert head.status_code == 200 and head.content == b""
    for _, _, headers in world.index.seen:
        assert headers["Authorization"] == encode_basic_auth(USER, PASSWORD)
        assert RUN_TOKEN not in str(headers) and "Cookie" not in headers
    assert [(e.service, e.host, e.path, e.status) for e in world.broker.events] == [
        ("registry", "index", f"/simple/{PROJECT}/", 200),
        ("registry", "index", f"/packages/{WHEEL}", 200),
        ("registry", "index", f"/packages/{WHEEL}", 200),
    ]


@pytest.mark.parametrize(
    ("method", "path", "status", "rule"),
    [
        ("PUT", f"/index/packages/{WHEEL}", 405, "read"),
        ("POST", "/index/simple/", 405, "read"),
        ("DELETE", f"/index/packages/{WHEEL}", 405, "read"),
        ("GET", "/index/admin/users", 403, "paths"),
        ("GET", "/index/simplex/", 403, "paths"),
        ("GET", "/other/simple/", 404, "not granted"),
    ],
)
def test_writes_other_paths_and_other_registries_are_refused(world, method, path, status, rule):
    answer = httpx.request(method, world.url + path, auth=("covey", RUN_TOKEN))
    assert answer.status_code == status
    assert answer.json()["rule"] == rule and answer.json()["message"].startswith("covey: ")
    assert world.index.seen == []


@pytest.mark.parametrize(
    ("request_line", "headers", "status"),
    [
        ("GET /registry/index/simple/../admin/ HTTP/1.1", "", b"400"),
        ("GET /registry/index/simple/%2e%2e/admin/ HTTP/1.1", "", b"400"),
        ("GET /registry/index/packages%2F..%2Fadmin HTTP/1.1", "", b"400"),
        ("GET /registry/index//simple/ HTTP/1.1", "", b"400"),
        ("GET /registry/index/simple/ HTTP/1.1", "", b"403"),
        ("GET /registry/index/simple/ HTTP/1.1", "Authorization: Basic !!!\r\n", b"403"),
        (
            "GET /registry/index/simple/ HTTP/1.1",
            f"Authorization: Bearer {RUN_TOKEN}\r\nAuthorization: Basic eDp5\r\n",
            b"403",
        ),
    ],
)
def test_hostile_requests_are_refused_before_the_index_sees_anything(
    world, request_line, headers, status
):
    answer = raw(
        world.url, f"{request_line}\r\nHost: x\r\n{headers}Connection: close\r\n\r\n".encode()
    )
    assert answer.split(b" ", 2)[1] == status, answer
    assert world.index.seen == []


def test_a_password_the_index_refuses_is_named(world):
    world.index.password = "rotated-elsewhere"
    answer = httpx.get(f"{world.url}/index/simple/", auth=("covey", RUN_TOKEN))
    assert answer.status_code == 502
    assert (
        answer.json()["message"]
        == "covey: registry index refused the connection's credential (401)"
    )
