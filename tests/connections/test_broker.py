"""The gateway's git route against the real git client and a stand-in git host (git
http-backend over TLS with a test CA): clone, fetch and push within a grant, every refusal said
the way git prints it, and the upstream never seeing the run's token nor a push that was
refused."""

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import ClientSession, TCPConnector, web

from connections.broker import (
    GitAccess,
    GitEvent,
    GitRoute,
    NotGranted,
    RegistryAccess,
    Unauthenticated,
)
from connections.github import InstallationTokens
from connections.rules import GitGrant, default_push
from tests.connections.gitenv import git_env
from tests.connections.githost import GitHost, Servers
from tests.netfixtures import TestCA

RUN_TOKEN = "covey-run-token-of-the-test"
UPSTREAM_SECRET = "ghs_the-installation-token-only-the-host-knows"


class FakeBroker:
    """One run's token, one connection (git.test), and a grant the test may change."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.grant = GitGrant(repositories=("acme/app",), push=default_push("builder"))
        self.secret = UPSTREAM_SECRET
        self.events: list[GitEvent] = []

    def git_access(self, token: str, host: str, repository: str) -> GitAccess:
        if token != RUN_TOKEN:
            raise Unauthenticated
        if host != "git.test" or not self.grant.covers(repository):
            raise NotGranted
        basic = GitHost(Path("."), self.secret).authorization
        return GitAccess(1, f"https://127.0.0.1:{self.port}", {"Authorization": basic}, self.grant)

    def api_access(self, token: str, host: str, repository: str) -> GitAccess:
        raise NotGranted

    def registry_access(self, token: str, name: str) -> RegistryAccess:
        raise NotGranted

    def record(self, token: str, event: GitEvent) -> None:
        self.events.append(event)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[GitHost, FakeBroker, str]]:
    ca = TestCA(tmp_path)
    host = GitHost(tmp_path / "host", UPSTREAM_SECRET)
    (tmp_path / "host").mkdir()
    host.repository("acme/app")
    host.repository("acme/secret")
    servers = Servers()
    try:
        upstream_app = web.Application()
        upstream_app.router.add_route("*", "/{tail:.*}", host.handle)
        port = servers.serve(upstream_app, ca.issue("127.0.0.1"))
        broker = FakeBroker(port)
        session: list[ClientSession] = []

        async def make_session() -> None:
            session.append(ClientSession(connector=TCPConnector(ssl=ca.client_context())))

        servers.call(make_session)
        route = GitRoute(
            broker,
            lambda: session[0],
            InstallationTokens(lambda: session[0]),
            max_push_bytes=10 * 1024 * 1024,
        )
        gateway = web.Application()
        gateway.router.add_route("*", "/git/{tail:.*}", route.handle)
        gateway_port = servers.serve(gateway)
        yield host, broker, f"http://127.0.0.1:{gateway_port}/git/git.test"

        async def close_session() -> None:
            await session[0].close()

        servers.call(close_session)
    finally:
        servers.close()


def git(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-c", f"http.extraHeader=Authorization: Bearer {RUN_TOKEN}", *args],
        cwd=cwd, env=git_env(cwd), capture_output=True, text=True, check=check,
    )  # fmt: skip


def clone(url: str, tmp_path: Path, name: str = "app") -> Path:
    work = tmp_path / f"work-{name}"
    git("clone", "-q", f"{url}/acme/{name}.git", str(work), cwd=tmp_path)
    return work


def commit(work: Path, text: str) -> str:
    (work / "README").write_text(text + "\n")
    git("commit", "-qam", text, cwd=work)
    return git("rev-parse", "HEAD", cwd=work).stdout.strip()


def test_an_agent_clones_and_pushes_its_branch_and_the_host_sees_only_the_connection(
    world, tmp_path
):
    host, broker, url = world
    work = clone(url, tmp_path)
    assert (work / "README").read_text() == "acme/app\n"
    new = commit(work, "two")
    pushed = git("push", "origin", "HEAD:refs/heads/covey/builder/two", cwd=work, check=False)
    assert pushed.returncode == 0, pushed.stderr
    assert host.ref("acme/app", "refs/heads/covey/builder/two") == new
    for seen in host.seen:
        assert seen.headers["Authorization"] == host.authorization
        assert RUN_TOKEN not in str(seen.headers)
    push = broker.events[-1]
    assert (push.service, push.status, push.refused) == ("git-receive-pack", 200, "")
    assert [(r.ref, r.new, r.refused) for r in push.refs] == [
        ("refs/heads/covey/builder/two", new, "")
    ]


def test_a_push_to_the_default_branch_is_refused_per_ref_and_never_reaches_the_host(
    world, tmp_path
):
    host, broker, url = world
    work = clone(url, tmp_path)
    before = host.ref("acme/app", "refs/heads/main")
    commit(work, "two")
    posts = len([s for s in host.seen if s.method == "POST"])
    pushed = git(
        "push", "origin", "HEAD:refs/heads/main", "HEAD:refs/heads/covey/builder/x",
        cwd=work, check=False,
    )  # fmt: skip
    assert pushed.returncode != 0
    assert "remote: covey: protected by covey: the default branch (HEAD)" in pushed.stderr
    assert "! [remote rejected] HEAD -> main (protected by covey" in pushed.stderr
    assert "HEAD -> covey/builder/x (refused: another ref of this push was refused)" in (
        pushed.stderr
    )
    assert host.ref("acme/app", "refs/heads/main") == before
    assert not host.ref("acme/app", "refs/heads/covey/builder/x")
    assert len([s for s in host.seen if s.method == "POST"]) == posts  # no push went up
    assert (
        broker.events[-1].refused
        == "protected by covey: the default branch (HEAD) is never pushed to by an agent"
    )


def test_force_pushes_and_deletes_only_as_the_grant_says(world, tmp_path):
    host, broker, url = world
    work = clone(url, tmp_path)
    commit(work, "two")
    git("push", "-q", "origin", "HEAD:refs/heads/covey/builder/x", cwd=work)
    git("commit", "-q", "--amend", "-m", "two, again", cwd=work)
    forced = git(
        "push", "--force", "origin", "HEAD:refs/heads/covey/builder/x", cwd=work, check=False
    )
    assert forced.returncode != 0
    assert "force-pushing" in forced.stderr or "a force-push" in forced.stderr
    deleted = git("push", "origin", ":refs/heads/covey/builder/x", cwd=work, check=False)
    assert "does not allow deleting a branch" in deleted.stderr
    assert host.ref("acme/app", "refs/heads/covey/builder/x")

    broker.grant = replace(broker.grant, force_push=True, delete=True)
    amended = git("rev-parse", "HEAD", cwd=work).stdout.strip()
    forced = git(
        "push", "--force", "origin", "HEAD:refs/heads/covey/builder/x", cwd=work, check=False
    )
    assert forced.returncode == 0, forced.stderr
    assert host.ref("acme/app", "refs/heads/covey/builder/x") == amended
    deleted = git("push", "origin", ":refs/heads/covey/builder/x", cwd=work, check=False)
    assert deleted.returncode == 0, deleted.stderr
    assert not host.ref("acme/app", "refs/heads/covey/builder/x")


def test_a_repository_not_granted_is_not_found_and_never_asked_for(world, tmp_path):
    host, broker, url = world
    assert broker.grant.covers("acme/app")
    cloned = git("clone", f"{url}/acme/secret.git", str(tmp_path / "s"), cwd=tmp_path, check=False)
    assert cloned.returncode != 0
    assert "not found" in cloned.stderr
    assert not any("secret" in seen.path for seen in host.seen)
    other = git(
        "clone",
        f"{url[:-8]}other.test/acme/app.git",
        str(tmp_path / "o"),
        cwd=tmp_path,
        check=False,
    )
    assert other.returncode != 0
    assert not host.seen


def test_a_credential_the_host_refuses_is_named_to_the_agent(world, tmp_path):
    _, broker, url = world
    broker.secret = "a-revoked-token"
    cloned = git("clone", f"{url}/acme/app.git", str(tmp_path / "a"), cwd=tmp_path, check=False)
    assert cloned.returncode != 0
    refused = "git.test refused the connection's credential (401)"
    assert f"remote: covey: {refused}" in cloned.stderr
    assert (broker.events[-1].status, broker.events[-1].problem) == (502, refused)


def raw(url: str, request: bytes) -> bytes:
    port = int(url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    ("request_line", "headers", "status"),
    [
        ("GET /git/git.test/acme/app/../secret/info/refs?service=git-upload-pack", "", b"400"),
        ("GET /git/git.test/acme/%2e%2e/info/refs?service=git-upload-pack", "", b"400"),
        ("GET /git/git.test/acme/app.git/info/refs?service=git-upload-pack", "", b"403"),
        (
            "GET /git/git.test/acme/app.git/info/refs?service=git-upload-pack",
            f"Authorization: Bearer {RUN_TOKEN}\r\nAuthorization: Basic eDp5\r\n",
            b"403",
        ),
        (
            "GET /git/git.test/acme/app.git/info/refs?service=git-upload-pack",
            "Authorization: Bearer not-a-run-token\r\n",
            b"403",
        ),
    ],
)
def test_hostile_requests_are_refused_before_the_host_sees_anything(
    world, request_line, headers, status
):
    host, _, url = world
    answer = raw(
        url, f"{request_line} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n".encode()
    )
    assert answer.split(b" ")[1] == status, answer[:300]
    assert not host.seen


def test_a_push_whose_pkt_lines_lie_is_refused_before_the_host_sees_it(world):
    host, _, url = world
    body = b"00ff" + b"0" * 40 + b" " + b"1" * 40 + b" refs/heads/covey/builder/x\x00report-status"
    answer = raw(
        url,
        b"POST /git/git.test/acme/app.git/git-receive-pack HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {RUN_TOKEN}\r\n".encode()
        + b"Content-Type: application/x-git-receive-pack-request\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body,
    )
    assert answer.split(b" ")[1] == b"400", answer[:300]
    assert b"ended before its commands" in answer
    assert not [seen for seen in host.seen if seen.method == "POST"]


def test_a_push_larger_than_git_s_post_buffer_is_probed_then_streamed(world, tmp_path):
    host, broker, url = world
    work = clone(url, tmp_path)
    (work / "large.bin").write_bytes(os.urandom(512 * 1024))
    git("add", "large.bin", cwd=work)
    git("commit", "-qm", "large", cwd=work)
    pushed = git(
        "-c", "http.postBuffer=65536", "push", "origin", "HEAD:refs/heads/covey/builder/large",
        cwd=work, check=False,
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    new = git("rev-parse", "HEAD", cwd=work).stdout.strip()
    assert host.ref("acme/app", "refs/heads/covey/builder/large") == new
    posts = [s for s in host.seen if s.method == "POST" and s.path.endswith("git-receive-pack")]
    assert len(posts) == 2  # the probe, then the push
    assert posts[1].headers.get("Transfer-Encoding") == "chunked"
    assert broker.events[-1].refs[0].new == new


def test_a_broker_that_fails_is_503_and_nothing_goes_upstream(world, tmp_path):
    host, broker, url = world

    def fail(*args):
        raise RuntimeError("the database is down")

    broker.git_access = fail
    cloned = git("clone", f"{url}/acme/app.git", str(tmp_path / "a"), cwd=tmp_path, check=False)
    assert cloned.returncode != 0 and "covey cannot read its records just now" in cloned.stderr
    assert host.seen == []
