"""The model gateway's git route over covey's database (budgets/gateway/broker.py), with real git,
PostgreSQL and a stand-in git host over TLS: a run's token reaches what its agent's grants name
as they are now (a grant revoked during a run refuses its next request), with the credential as
it is now (a rotation is used by the next request); every request is on the record, and what
the host said of a credential it refused is the connection's status."""

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from agents import services as agent_services
from agents.models import Agent
from budgets import keys
from budgets.gateway.ledger import KEPT_SECONDS
from budgets.models import GatewayToken
from connections import services
from connections.models import Connection, CredentialedRequest
from runs import services as runs
from tests.budgets.conftest import Gateway, ca, start_gateway, vendor  # noqa: F401 - fixtures
from tests.connections.gitenv import git_env
from tests.connections.githost import GitHost, Servers

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SECRET = "glpat-the-connections-own-token-0123456789"
ROTATED = "glpat-the-rotated-token-9876543210"


@dataclass
class World:
    host: GitHost
    connection: Connection
    agent: Agent
    token: str
    url: str  # the repository acme/app at the gateway
    tmp: Path

    def git(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        header = f"http.extraHeader=Authorization: Bearer {self.token}"
        return subprocess.run(
            ["git", "-c", header, *args], cwd=cwd or self.tmp, env=git_env(self.tmp),
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip


def later() -> None:
    """Past what the gateway keeps of tokens, grants and credentials."""
    time.sleep(KEPT_SECONDS * 1.2)


@pytest.fixture(scope="module")
def upstream(ca) -> Iterator[tuple[Servers, int, list[GitHost]]]:  # noqa: F811 - the fixture
    """The stand-in git host's server (the test gives it its host), trusted by the gateway."""
    servers = Servers()
    hosts: list[GitHost] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        return await hosts[-1].handle(request)

    try:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        port = servers.serve(app, ca.issue("127.0.0.1"))
        yield servers, port, hosts
    finally:
        servers.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, vendor, ca) -> Iterator[Gateway]:  # noqa: F811 - the fixtures
    with start_gateway(tmp_path_factory.mktemp("gateway"), vendor, ca) as gateway:
        yield gateway
    assert SECRET not in gateway.output() and ROTATED not in gateway.output()


@pytest.fixture
def world(tmp_path: Path, acme, upstream, gateway) -> World:
    _, port, hosts = upstream
    host = GitHost(tmp_path / "host", SECRET)
    host.repository("acme/app")
    host.repository("acme/secret")
    hosts.append(host)
    connection = services.create_connection(
        acme, "forge", "token", SECRET, git_url=f"https://127.0.0.1:{port}",
        scheme="basic", username="x-access-token",
    )  # fmt: skip
    agent = agent_services.create_agent(
        acme, "Builder", credential_grants=[{"connection": "forge", "repositories": ["acme/app"]}]
    )
    run = runs.queue_run(agent, "work on acme/app")
    token = keys.issue_gateway_token(agent, run_id=run.pk, ttl=timedelta(hours=1))
    url = f"{gateway.url}/git/127.0.0.1:{port}/acme/app.git"
    return World(host, connection, agent, token, url, tmp_path)


def test_a_run_clones_and_pushes_within_its_grant_and_every_request_is_recorded(world):
    assert world.git("clone", world.url, "app").returncode == 0
    work = world.tmp / "app"
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "work"], cwd=work,
                   env=git_env(world.tmp), check=True)  # fmt: skip
    pushed = world.git("push", "origin", "HEAD:refs/heads/covey/builder/work", cwd=work)
    assert pushed.returncode == 0, pushed.stderr
    refused = world.git("push", "origin", "HEAD:main", cwd=work)
    assert refused.returncode != 0 and "protected by covey" in refused.stderr
    head = world.host.ref("acme/app", "covey/builder/work")
    assert head and world.host.ref("acme/app", "main") != head
    # The host saw the connection's credential, never the run's token.
    assert all(world.token not in str(seen.headers) for seen in world.host.seen)

    records = list(CredentialedRequest.objects.order_by("at", "pk"))
    assert {r.agent_id for r in records} == {world.agent.pk}
    assert {r.connection_id for r in records} == {world.connection.pk}
    pushes = [r for r in records if r.service == "git-receive-pack" and r.refs]
    assert [(p.refs[0]["ref"], p.refs[0]["new"], p.refused) for p in pushes] == [
        ("refs/heads/covey/builder/work", head, ""),
        (
            "refs/heads/main",
            head,
            "protected by covey: the default branch (HEAD) is never pushed to by an agent",
        ),
    ]
    assert all(r.refused == "" for r in records if r.service == "git-upload-pack")


def test_a_rotation_is_used_by_the_next_request_and_a_refusal_is_the_connections_status(world):
    assert world.git("ls-remote", world.url).returncode == 0
    world.host.credential = ROTATED  # the host revoked the old token
    refused = world.git("ls-remote", world.url)
    assert "refused the connection's credential (401)" in refused.stderr
    world.connection.refresh_from_db()
    assert world.connection.status.endswith("refused the connection's credential (401)")
    assert world.connection.status_at is not None
    services.rotate_secret(world.connection, ROTATED)
    later()
    listed = world.git("ls-remote", world.url)
    assert listed.returncode == 0, listed.stderr
    assert world.host.seen[-1].headers["Authorization"] == world.host.authorization
    failed = CredentialedRequest.objects.filter(status=502).get()
    assert failed.refused.endswith("refused the connection's credential (401)")


def test_a_grant_revoked_during_a_run_refuses_its_next_request(world):
    assert world.git("ls-remote", world.url).returncode == 0
    other = world.url.replace("acme/app", "acme/secret")
    assert "repository acme/secret not found" in world.git("ls-remote", other).stderr
    agent_services.update_agent(world.agent, credential_grants=[])
    later()
    gone = world.git("ls-remote", world.url)
    assert gone.returncode != 0 and "repository acme/app not found" in gone.stderr
    refused = CredentialedRequest.objects.filter(refused="not granted")
    assert [(r.repository, r.connection_id, r.status) for r in refused.order_by("at")] == [
        ("acme/secret", None, 404),
        ("acme/app", None, 404),
    ]
    assert not [seen for seen in world.host.seen if "secret" in seen.path]


def test_a_token_whose_run_ended_is_refused(world):
    GatewayToken.objects.update(revoked_at=world.connection.secret_set_at)
    later()
    refused = world.git("ls-remote", world.url)
    assert refused.returncode != 0 and "this token is no running agent's" in refused.stderr, (
        refused.stderr
    )
    assert not world.host.seen


def test_a_token_of_no_run_is_refused(world):
    token = keys.issue_gateway_token(world.agent, run_id=None, ttl=timedelta(hours=1))
    world.token = token
    refused = world.git("ls-remote", world.url)
    assert "this token is no running agent's" in refused.stderr and not world.host.seen


def test_the_repository_goes_upstream_as_the_grant_spells_it(world):
    """git http-backend minds case, as some hosts do: another spelling of a granted name
    reaches the granted repository, never another one."""
    listed = world.git("ls-remote", world.url.replace("acme/app", "ACME/App"))
    assert listed.returncode == 0, listed.stderr
    assert {seen.path.split(".git")[0] for seen in world.host.seen} == {"/acme/app"}
    assert {r.repository for r in CredentialedRequest.objects.all()} == {"acme/app"}


def test_every_refusal_is_recorded_even_with_a_method_longer_than_the_column(world):
    api = world.url.replace("/git/", "/api/").replace("/acme/app.git", "")
    answer = httpx.request(
        "UNSUBSCRIBE", f"{api}/repos/acme/app", headers={"Authorization": f"Bearer {world.token}"}
    )
    assert answer.status_code == 404  # the forge has no API: nothing is granted there
    recorded = CredentialedRequest.objects.get()
    assert (recorded.method, recorded.refused) == ("UNSUBSCRIB", "not granted")


def test_what_a_host_said_of_a_rotated_credential_is_not_the_new_one_s_status(world):
    """A request in flight with the old credential, answered after a rotation, leaves the
    connection's status to the new one."""
    from budgets.gateway.broker import DjangoBroker
    from budgets.gateway.ledger import DjangoLedger
    from connections.broker import GitEvent

    host = world.url.split("/git/", 1)[1].split("/", 1)[0]

    def refused_now(broker: DjangoBroker) -> GitEvent:
        access = broker.git_access(world.token, host, "acme/app")
        return GitEvent(
            connection_id=world.connection.pk, host=host, repository="acme/app",
            service="git-upload-pack", method="GET", status=502,
            problem=f"{host} refused the connection's credential (401)",
            credential_at=access.credential_at,
        )  # fmt: skip

    in_flight = refused_now(DjangoBroker(DjangoLedger()))
    services.rotate_secret(world.connection, ROTATED)
    DjangoBroker(DjangoLedger()).record(world.token, in_flight)
    world.connection.refresh_from_db()
    assert world.connection.status == ""
    broker = DjangoBroker(DjangoLedger())
    broker.record(world.token, refused_now(broker))
    world.connection.refresh_from_db()
    assert world.connection.status.endswith("refused the connection's credential (401)")
