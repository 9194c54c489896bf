"""The push reader and the refusal against the real git: ``git push`` over smart HTTP to a
small server on loopback that reads each push's head as the gateway will, then either hands the
whole body to ``git receive-pack`` (the push lands: the reader took exactly the head) or answers
with covey's refusal (git prints it per ref; the repository is unchanged)."""

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from connections.packs import Commits, PackReader
from connections.smarthttp import Push, PushReader, Service, pkt_line, refusal, route
from tests.connections.gitenv import git_env

Decide = Callable[[Push], dict[str, str]]  # the refused refs and why; none: the push goes on


def git(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = git_env(cwd)
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=check
    )


class Upstream:
    """A bare repository served by ``git receive-pack --stateless-rpc``, with a judge in
    front."""

    def __init__(self, bare: Path) -> None:
        self.bare = bare
        self.decide: Decide = lambda push: {}
        self.pushes: list[Push] = []
        self.packs: list[Commits] = []

    def advertise(self) -> bytes:
        refs = subprocess.run(
            ["git", "receive-pack", "--stateless-rpc", "--advertise-refs", str(self.bare)],
            capture_output=True,
            check=True,
        ).stdout
        return pkt_line(b"# service=git-receive-pack\n") + pkt_line(b"") + refs

    def receive(self, body: bytes) -> bytes:
        reader = PushReader()
        push = None
        for start in range(0, len(body), 7):  # in small pieces, as a socket may give them
            if push := reader.feed(body[start : start + 7]):
                rest = reader.rest + body[start + 7 :]
                break
        assert push is not None
        assert body.endswith(rest)
        self.pushes.append(push)
        if rest:
            packs = PackReader(id_length=push.id_length, max_bytes=len(rest))
            packs.feed(rest)
            self.packs.append(packs.finish())
        if reasons := self.decide(push):
            return refusal(push, reasons, message="; ".join(reasons.values()))
        return subprocess.run(
            ["git", "receive-pack", "--stateless-rpc", str(self.bare)],
            input=body,
            capture_output=True,
            check=True,
        ).stdout


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[Upstream, str]]:
    bare = tmp_path / "app.git"
    git("init", "--bare", "--initial-branch=main", str(bare), cwd=tmp_path)
    seed = tmp_path / "seed"
    git("init", "--initial-branch=main", str(seed), cwd=tmp_path)
    (seed / "README").write_text("one\n")
    git("add", "README", cwd=seed)
    git("commit", "-m", "one", cwd=seed)
    git("push", str(bare), "main", cwd=seed)
    served = Upstream(bare)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            assert route("GET", path, query).service == Service.RECEIVE_PACK
            self.answer("application/x-git-receive-pack-advertisement", served.advertise())

        def do_POST(self) -> None:
            path, _, query = self.path.partition("?")
            assert route("POST", path, query).service == Service.RECEIVE_PACK
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.answer("application/x-git-receive-pack-result", served.receive(body))

        def answer(self, content_type: str, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_port}/git/git.test/acme/app.git"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def clone(upstream: tuple[Upstream, str], tmp_path: Path) -> Path:
    served, url = upstream
    work = tmp_path / "work"
    git("clone", str(served.bare), str(work), cwd=tmp_path)
    git("remote", "set-url", "--push", "origin", url, cwd=work)
    return work


def commit(work: Path, text: str) -> str:
    (work / "README").write_text(text)
    git("commit", "-am", text, cwd=work)
    return git("rev-parse", "HEAD", cwd=work).stdout.strip()


def upstream_ref(served: Upstream, ref: str) -> str:
    return git("rev-parse", "--verify", "--quiet", ref, cwd=served.bare, check=False).stdout


def test_a_push_read_by_covey_lands_whole_in_the_upstream(upstream, clone):
    served, _ = upstream
    new = commit(clone, "two")
    result = git("push", "origin", "HEAD:refs/heads/covey/builder/two", cwd=clone, check=False)
    assert result.returncode == 0, result.stderr
    assert upstream_ref(served, "refs/heads/covey/builder/two").strip() == new
    (push,) = served.pushes
    assert [(c.ref, c.new, c.creates) for c in push.commands] == [
        ("refs/heads/covey/builder/two", new, True)
    ]
    assert {"report-status", "report-status-v2"} & push.capabilities


def test_git_push_prints_covey_s_refusal_per_ref_and_nothing_lands(upstream, clone):
    served, _ = upstream
    before = upstream_ref(served, "refs/heads/main")
    commit(clone, "two")
    served.decide = lambda push: {
        "refs/heads/main": "protected by covey: the default branch (HEAD) is never pushed to"
    }
    result = git(
        "push", "origin", "HEAD:refs/heads/main", "HEAD:refs/heads/covey/builder/two",
        cwd=clone, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "remote: covey: protected by covey: the default branch (HEAD)" in result.stderr
    assert (
        "! [remote rejected] HEAD -> main (protected by covey: the default branch (HEAD) is"
        " never pushed to)"
    ) in result.stderr
    assert "! [remote rejected] HEAD -> covey/builder/two (refused: another ref of this push" in (
        result.stderr
    )
    assert upstream_ref(served, "refs/heads/main") == before
    assert not upstream_ref(served, "refs/heads/covey/builder/two")


def test_a_delete_is_read_with_no_pack_after_it(upstream, clone):
    served, _ = upstream
    commit(clone, "two")
    git("push", "origin", "HEAD:refs/heads/covey/builder/gone", cwd=clone)
    result = git("push", "origin", ":refs/heads/covey/builder/gone", cwd=clone, check=False)
    assert result.returncode == 0, result.stderr
    assert served.pushes[-1].commands[0].deletes
    assert not upstream_ref(served, "refs/heads/covey/builder/gone")


def test_the_pack_of_a_real_push_tells_a_fast_forward_from_a_force_push(upstream, clone):
    served, _ = upstream
    first = commit(clone, "two")
    git("push", "origin", "HEAD:refs/heads/covey/builder/x", cwd=clone)
    second = commit(clone, "three")
    git("push", "origin", "HEAD:refs/heads/covey/builder/x", cwd=clone)
    (update,) = served.pushes[-1].commands
    assert (update.old, update.new) == (first, second)
    assert served.packs[-1].descends(update.new, update.old) is True

    git("commit", "--amend", "-m", "three, again", cwd=clone)
    result = git("push", "--force", "origin", "HEAD:refs/heads/covey/builder/x", cwd=clone)
    assert result.returncode == 0, result.stderr
    (update,) = served.pushes[-1].commands
    assert update.old == second
    assert served.packs[-1].descends(update.new, update.old) is None


def test_the_default_branch_is_read_from_a_real_fetch_advertisement(tmp_path):
    from connections.smarthttp import default_branch

    bare = tmp_path / "t.git"
    git("init", "--bare", "--initial-branch=trunk", str(bare), cwd=tmp_path)
    seed = tmp_path / "seed"
    git("init", "--initial-branch=trunk", str(seed), cwd=tmp_path)
    (seed / "f").write_text("x\n")
    git("add", "f", cwd=seed)
    git("commit", "-m", "x", cwd=seed)
    git("push", str(bare), "trunk", cwd=seed)
    refs = subprocess.run(
        ["git", "upload-pack", "--stateless-rpc", "--advertise-refs", str(bare)],
        capture_output=True, check=True, env={**os.environ, "GIT_PROTOCOL": ""},
    ).stdout  # fmt: skip
    advertisement = pkt_line(b"# service=git-upload-pack\n") + pkt_line(b"") + refs
    assert default_branch(advertisement) == "refs/heads/trunk"
    assert default_branch(advertisement[:30]) is None  # cut short
    assert default_branch(b"zzzz") is None
    assert default_branch(pkt_line(b"# service=git-upload-pack\n") + b"0000") is None
    hostile = pkt_line(b"a" * 40 + b" HEAD\0symref=HEAD:refs/heads/../x\n")
    assert default_branch(hostile) is None
