"""A GitHub App's installation tokens against a stand-in of GitHub's API (TLS with a test CA)
that verifies the app's JSON Web Token with the app's public key, as GitHub does."""

import asyncio
import re
import time

import pytest
from aiohttp import ClientSession, TCPConnector, web
from cryptography.hazmat.primitives.asymmetric import rsa

from connections.github import (
    GitHubApp,
    GitHubRefused,
    InstallationTokens,
    api_permissions,
    git_permissions,
)
from tests.connections.githost import Servers
from tests.connections.githubapi import GitHub
from tests.connections.keys import pem
from tests.netfixtures import TestCA


@pytest.fixture(scope="module")
def key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def github(tmp_path, key):
    ca = TestCA(tmp_path)
    stand_in = GitHub(key)
    servers = Servers()
    app = web.Application()
    app.router.add_post("/app/installations/{installation}/access_tokens", stand_in.access_tokens)
    port = servers.serve(app, ca.issue("127.0.0.1"))
    sessions: list[ClientSession] = []

    async def make() -> None:
        sessions.append(ClientSession(connector=TCPConnector(ssl=ca.client_context())))

    servers.call(make)
    try:
        yield servers, stand_in, f"https://127.0.0.1:{port}", lambda: sessions[0]
    finally:

        async def close() -> None:
            await sessions[0].close()

        servers.call(close)
        servers.close()


WRITE = {"metadata": "read", "contents": "write", "pull_requests": "write", "issues": "write"}


def test_a_token_is_minted_for_one_repository_and_its_permissions_then_reused(github, key):
    servers, stand_in, url, session = github
    now = [time.time()]
    tokens = InstallationTokens(session, clock=lambda: now[0])
    app = GitHubApp("12", "34", pem(key), url)
    first = servers.call(lambda: tokens.token(app, "acme/app", WRITE))
    assert first == "ghs_minted_1"
    assert stand_in.minted == [{"repositories": ["app"], "permissions": WRITE}]
    assert servers.call(lambda: tokens.token(app, "Acme/App", WRITE)) == first  # cached
    other = servers.call(lambda: tokens.token(app, "acme/docs", WRITE))
    assert other == "ghs_minted_2"  # another repository, another token
    now[0] += 3600 - 299  # within five minutes of its end: renewed
    assert servers.call(lambda: tokens.token(app, "acme/app", WRITE)) == "ghs_minted_3"
    tokens.forget(app)
    assert servers.call(lambda: tokens.token(app, "acme/docs", WRITE)) == "ghs_minted_4"


def test_a_burst_of_requests_mints_once(github, key):
    servers, stand_in, url, session = github
    tokens = InstallationTokens(session)
    app = GitHubApp("12", "34", pem(key), url)

    async def burst() -> list[str]:
        return list(
            await asyncio.gather(*(tokens.token(app, "acme/app", WRITE) for _ in range(20)))
        )

    assert set(servers.call(burst)) == {"ghs_minted_1"}
    assert len(stand_in.minted) == 1


@pytest.mark.parametrize(
    ("app_id", "installation", "repository", "other_key", "says"),
    [
        ("12", "34", "acme/private", False, "installation 34 lacks acme/private"),
        ("12", "35", "acme/app", False, "knows no installation 35 of app 12"),
        ("13", "34", "acme/app", False, "refused the GitHub App's key (app 13)"),
        ("12", "34", "acme/app", True, "refused the GitHub App's key (app 12)"),
    ],
)
def test_a_refusal_says_what_to_fix(github, key, app_id, installation, repository, other_key, says):
    servers, stand_in, url, session = github
    signing = rsa.generate_private_key(public_exponent=65537, key_size=2048) if other_key else key
    app = GitHubApp(app_id, installation, pem(signing), url)
    with pytest.raises(GitHubRefused, match=re.escape(says)):
        servers.call(lambda: InstallationTokens(session).token(app, repository, WRITE))
    assert not stand_in.minted


def test_a_host_that_does_not_answer_is_named(github, key):
    servers, _, _, session = github
    app = GitHubApp("12", "34", pem(key), "https://127.0.0.1:1")
    with pytest.raises(GitHubRefused, match=r"127\.0\.0\.1:1 did not answer"):
        servers.call(lambda: InstallationTokens(session).token(app, "acme/app", WRITE))


@pytest.mark.parametrize(
    ("api", "permissions"),
    [
        ({"read", "pulls", "comments"}, {
            "metadata": "read", "contents": "read", "pull_requests": "write", "issues": "write",
        }),
        ({"read"}, {
            "metadata": "read", "contents": "read", "pull_requests": "read", "issues": "read",
        }),
        (set(), {"metadata": "read"}),
        ({"issues"}, {"metadata": "read", "issues": "write"}),
        ({"comments"}, {"metadata": "read", "pull_requests": "write", "issues": "write"}),
    ],
)  # fmt: skip
def test_an_api_token_gets_no_more_than_the_grant_s_calls_need(api, permissions):
    assert api_permissions(frozenset(api)) == permissions


def test_a_git_token_gets_contents_only():
    assert git_permissions(True) == {"metadata": "read", "contents": "write"}
    assert git_permissions(False) == {"metadata": "read", "contents": "read"}


def test_a_refusal_is_said_again_without_asking_for_a_while(github, key):
    servers, stand_in, url, session = github
    app = GitHubApp("12", "34", pem(key), url)
    tokens = InstallationTokens(session)
    for _ in range(3):
        with pytest.raises(GitHubRefused, match="lacks acme/secret"):
            servers.call(lambda: tokens.token(app, "acme/secret", git_permissions(False)))
    assert stand_in.asked == 1
