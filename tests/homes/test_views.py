"""The homes API's views on the control plane, with the runner's own code answering from a real
home on disk (runners/host/serving.py and runners/host/homes.py, called in-process instead of
over a queue): a download's HEAD refuses what its GET refuses, in the same words."""

import os
import socket

import pytest

from agents.models import Agent
from homes import services
from homes.services import HomeProblem
from runners.host import serving
from runners.host.homes import Home, HomeError
from runners.protocol import HomeAnswer, HomeOp, HomeOrder
from tests.factories import AgentFactory, online_runner

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent(acme):
    agent = AgentFactory(organisation=acme, name="Keeper")
    runner, _ = online_runner(acme)
    Agent.objects.filter(pk=agent.pk).update(home_runner=runner)
    agent.refresh_from_db()
    return agent


@pytest.fixture
def home(tmp_path, monkeypatch) -> Home:
    """A home on disk that the runner's own code serves: a look (stat) and a read, each
    answered or refused as the runner answers it."""
    home = Home(tmp_path / "home")
    home.root.mkdir()

    def ask(agent, kind, **fields) -> HomeAnswer:
        order = HomeOrder("op", agent.pk, kind, **fields)
        answer = serving._attempt(lambda: serving._look(home, order))
        if answer.status >= 400:
            raise HomeProblem(answer.status, answer.detail)
        return answer

    def download(agent, path, *, wire=None) -> services.Download:
        order = HomeOrder("op", agent.pk, HomeOp.READ, path=path)
        try:
            answer, chunks, size = serving._read(home, order)
        except HomeError as exc:
            raise HomeProblem(exc.status, str(exc)) from None
        got = b"".join(chunks)
        chunks.close()
        return services.Download(answer, size is None, size, iter([got]))

    monkeypatch.setattr(services, "ask", ask)
    monkeypatch.setattr(services, "download", download)
    return home


def test_a_head_refuses_what_a_download_refuses_in_the_same_words(
    api, alice, agent, home, tmp_path
):
    (home.root / "file.txt").write_bytes(b"twelve bytes")
    (home.root / "dir").mkdir()
    (home.root / "link").symlink_to("/etc/passwd")
    os.mkfifo(home.root / "fifo")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(home.root / "socket"))
    (tmp_path / "outside").write_bytes(b"outside the home")
    os.link(tmp_path / "outside", home.root / "hardlinked")
    client = api(alice)
    url = f"/api/v1/agents/{agent.pk}/home/download/"
    try:
        for path, refusal in [
            ("link", "link is a symbolic link: covey does not follow links"),
            ("fifo", "fifo is a fifo, not a file"),
            ("socket", "socket is a socket, not a file"),
            ("hardlinked", "hardlinked has 2 hard links (one may be outside the home)"),
        ]:
            got = client.get(url, {"path": path})
            head = client.head(url, {"path": path})  # no body: what its GET would say
            assert (got.status_code, got.json()["detail"]) == (400, refusal), path
            assert head.status_code == 400, path
            assert head.data["detail"] == refusal
    finally:
        listening.close()
    head = client.head(url, {"path": "file.txt"})
    assert (head.status_code, head["Content-Length"]) == (200, "12")
    assert client.head(url, {"path": "dir"})["Content-Type"] == "application/x-tar"
    assert client.get(url, {"path": "file.txt"}).getvalue() == b"twelve bytes"
