"""The gateway's API route before a stand-in of GitHub's REST API (TLS with a test CA): the
calls a grant names pass with the connection's credential in place of the run's token; every
other call, another repository and every hostile request are refused in JSON, naming the rule,
before the API sees anything."""

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import ClientSession, TCPConnector, web
from cryptography.hazmat.primitives.asymmetric import rsa

from connections.apibroker import ApiRoute
from connections.broker import GitAccess, GitEvent, NotGranted, RegistryAccess, Unauthenticated
from connections.github import InstallationTokens
from connections.rules import GitGrant, default_push
from tests.connections.githost import Servers
from tests.connections.githubapi import GitHub
from tests.connections.test_broker import raw
from tests.netfixtures import TestCA

RUN_TOKEN = "covey-run-token-of-the-api-test"
SECRET = "ghp_the-connections-own-token"


class FakeBroker:
    """One run's token, one API (api.git.test), acme/app granted with the default calls."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.api = frozenset({"read", "pulls", "comments"})
        self.secret = SECRET
        self.events: list[GitEvent] = []

    def git_access(self, token: str, host: str, repository: str) -> GitAccess:
        raise NotGranted

    def api_access(self, token: str, host: str, repository: str) -> GitAccess:
        if token != RUN_TOKEN:
            raise Unauthenticated
        grant = GitGrant(repositories=("acme/app",), push=default_push("builder"))
        if host != "api.git.test" or not grant.covers(repository):
            raise NotGranted
        headers = {"Authorization": f"Bearer {self.secret}"}
        return GitAccess(1, f"https://127.0.0.1:{self.port}", headers, grant, api=self.api)

    def registry_access(self, token: str, name: str) -> RegistryAccess:
        raise NotGranted

    def record(self, token: str, event: GitEvent) -> None:
        self.events.append(event)


@dataclass
class World:
    github: GitHub
    broker: FakeBroker
    url: str  # the API of api.git.test at the gateway

    def call(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {RUN_TOKEN}", **kwargs.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=10, **kwargs)


@pytest.fixture
def world(tmp_path) -> Iterator[World]:
    ca = TestCA(tmp_path)
    github = GitHub(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    github.also.add(SECRET)
    servers = Servers()
    session: list[ClientSession] = []
    try:
        upstream = web.Application()
        github.routes(upstream)
        broker = FakeBroker(servers.serve(upstream, ca.issue("127.0.0.1")))

        async def make_session() -> None:
            session.append(ClientSession(connector=TCPConnector(ssl=ca.client_context())))

        servers.call(make_session)
        route = ApiRoute(
            broker, lambda: session[0], InstallationTokens(lambda: session[0]), max_body_bytes=4096
        )
        gateway = web.Application()
        gateway.router.add_route("*", "/api/{tail:.*}", route.handle)
        port = servers.serve(gateway)
        yield World(github, broker, f"http://127.0.0.1:{port}/api/api.git.test")

        async def close_session() -> None:
            await session[0].close()

        servers.call(close_session)
    finally:
        servers.close()


def test_the_grant_s_calls_pass_with_the_connection_s_credential_only(world):
    read = world.call("GET", "/repos/acme/app", headers={"Cookie": "a=b", "X-Api-Key": "k"})
    assert read.status_code == 200 and read.json()["full_name"] == "acme/app"
    opened = world.call(
        "POST", "/repos/acme/app/pulls",
        json={"title": "Work", "head": "covey/builder/work", "base": "main"},
    )  # fmt: skip
    assert opened.status_code == 201 and opened.json()["number"] == 1
    assert world.github.pulls == [{"title": "Work", "head": "covey/builder/work", "base": "main"}]
    listed = world.call("GET", "/repos/acme/app/pulls", params={"state": "open"})
    assert [p["number"] for p in listed.json()] == [1]
    commented = world.call("POST", "/repos/acme/app/issues/1/comments", json={"body": "done"})
    assert commented.status_code == 200
    for _, _, headers in world.github.seen:
        assert headers["Authorization"] == f"Bearer {SECRET}"
        assert RUN_TOKEN not in str(headers)
        assert "Cookie" not in headers and "X-Api-Key" not in headers
    assert world.github.seen[2][1] == "/repos/acme/app/pulls?state=open"
    assert [(e.method, e.path, e.status, e.refused) for e in world.broker.events] == [
        ("GET", "/repos/acme/app", 200, ""),
        ("POST", "/repos/acme/app/pulls", 201, ""),
        ("GET", "/repos/acme/app/pulls", 200, ""),
        ("POST", "/repos/acme/app/issues/1/comments", 200, ""),
    ]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("PUT", "/repos/acme/app/pulls/1/merge"),  # merging is never a call
        ("POST", "/repos/acme/app/pulls/1/reviews"),  # nor a review
        ("POST", "/repos/acme/app/issues"),  # issues are not granted
        ("DELETE", "/repos/acme/app"),
        ("GET", "/repos/acme/app/actions/secrets"),
    ],
)
def test_a_call_the_grant_does_not_name_is_refused_naming_the_rule(world, method, path):
    answer = world.call(method, path, json={})
    assert answer.status_code in (400, 403), answer.text
    body = answer.json()
    assert body["message"].startswith("covey: ") and body["rule"] in ("call", "path")
    if answer.status_code == 403:
        assert "is no call the grant allows (it allows: comments, pulls, read;" in body["message"]
    assert world.github.seen == []


def test_a_redirect_is_not_passed_on(world):
    answer = world.call(
        "GET", "/repos/acme/app/releases/assets/7", headers={"Accept": "application/octet-stream"}
    )
    assert answer.status_code == 502 and "location" not in answer.headers
    assert answer.json()["rule"] == "redirect" and "presigned" not in answer.text
    assert world.broker.events[-1].refused.endswith("a redirect covey does not pass on")
    assert world.broker.events[-1].problem == ""  # the credential is fine


def test_a_method_no_api_call_has_is_refused_and_recorded(world):
    answer = world.call("UNSUBSCRIBE", "/repos/acme/app")
    assert answer.status_code == 405 and answer.json()["rule"] == "call"
    assert world.broker.events[-1].method == "UNSUBSCRIBE" and world.github.seen == []


def test_a_broker_that_fails_is_503_and_nothing_is_sent(world):
    def fail(*args):
        raise RuntimeError("the database is down")

    world.broker.api_access = fail
    answer = world.call("GET", "/repos/acme/app")
    assert answer.status_code == 503 and answer.json()["rule"] == "unavailable"
    assert world.github.seen == []


def test_another_repository_is_not_found_and_never_asked_for(world):
    answer = world.call("GET", "/repos/acme/secret")
    assert answer.status_code == 404
    assert answer.json() == {
        "message": "covey: repository acme/secret not found",
        "rule": "not granted",
    }
    assert world.github.seen == [] and world.broker.events[-1].refused == "not granted"


@pytest.mark.parametrize(
    ("request_line", "headers", "status"),
    [
        ("GET /api/api.git.test/repos/acme/app/../secret HTTP/1.1", "", b"400"),
        ("GET /api/api.git.test/repos/acme/%2e%2e/secret HTTP/1.1", "", b"400"),
        ("GET /api/api.git.test/repos/acme/app/contents/a%2Fb HTTP/1.1", "", b"400"),
        ("GET /api/api.git.test/repos/acme/app/contents/a%00 HTTP/1.1", "", b"400"),
        ("GET /api/api.git.test/repos/acme/app//x HTTP/1.1", "", b"400"),
        ("GET /api/api.git.test/user HTTP/1.1", "", b"400"),
        ("GET /api/API.git.test/repos/acme/app HTTP/1.1", "", b"400"),
        ("GET /api/api.git.test/repos/acme/app HTTP/1.1", "", b"403"),
        (
            "GET /api/api.git.test/repos/acme/app HTTP/1.1",
            f"Authorization: Bearer {RUN_TOKEN}\r\nAuthorization: Bearer {SECRET}\r\n",
            b"403",
        ),
        (
            "GET /api/api.git.test/repos/acme/app HTTP/1.1",
            "Authorization: Bearer not-a-run-token\r\n",
            b"403",
        ),
    ],
)
def test_hostile_requests_are_refused_before_the_api_sees_anything(
    world, request_line, headers, status
):
    answer = raw(
        world.url,
        f"{request_line}\r\nHost: x\r\n{headers}Connection: close\r\n\r\n".encode(),
    )
    assert answer.split(b" ", 2)[1] == status, answer
    assert b'"message": "covey: ' in answer
    assert world.github.seen == []


def test_a_body_larger_than_the_route_takes_is_refused(world):
    told = world.call("PATCH", "/repos/acme/app/pulls/1", content=b"x" * 5000)
    assert told.status_code == 413 and world.github.seen == []

    def chunks() -> Iterator[bytes]:
        yield b"x" * 3000
        yield b"x" * 3000

    streamed = world.call("PATCH", "/repos/acme/app/pulls/1", content=chunks())
    assert streamed.status_code == 413
    assert [e.status for e in world.broker.events] == [413, 413]  # both on the record
    assert world.broker.events[-1].refused == "the body is larger than 4096 bytes"


def test_a_credential_the_api_refuses_is_named_to_the_agent(world):
    world.broker.secret = "ghp_revoked"
    answer = world.call("GET", "/repos/acme/app")
    assert answer.status_code == 502
    assert answer.json()["message"] == (
        "covey: api.git.test refused the connection's credential (401)"
    )
    assert (
        world.broker.events[-1].problem == "api.git.test refused the connection's credential (401)"
    )
