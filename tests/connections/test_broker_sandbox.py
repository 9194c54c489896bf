"""A real sandbox of the default workplace image clones, commits and pushes to a private
repository of a stand-in git host with nothing but its run's configuration: the control plane
(gunicorn), a runner process, Docker, the gateway process, and the stand-in over TLS with the
test's CA. At the cooperative level with an access token, and under hard isolation (the gateway
reached through the runner's proxy container) with a GitHub App whose installation tokens the
gateway mints. Neither the credential nor a minted token is anywhere in the sandbox."""

import base64
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from budgets import keys
from budgets import services as budget_services
from connections import services
from connections.models import CredentialedRequest
from runners.host.containers.engine import Engine
from runs import services as run_services
from runs.models import FINISHED, RunStatus
from tests.budgets.conftest import KEY, ca, start_gateway, vendor  # noqa: F401 - fixtures
from tests.connections.githost import GitHost, Servers
from tests.connections.githubapi import GitHub
from tests.connections.keys import pem
from tests.connections.registryhost import PROJECT, WHEEL, WORD, Index
from tests.runners.conftest import egress_image, firewall  # noqa: F401 - fixtures
from tests.runners.stack import Stack
from tests.runners.world import World, runner_ids_apart

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]

SECRET = "glpat-the-organisations-own-token-0123456789"
INDEX_PASSWORD = "the-private-index-password-0123456789"
NEEDLES = base64.b64encode(f"{SECRET}\nghs_minted_\n{INDEX_PASSWORD}\n".encode()).decode()
PIP = f"""
python3 -m pip install -q --no-deps --target /tmp/pkgs --root-user-action ignore \\
    --index-url "$COVEY_REGISTRY_INDEX/simple/" {PROJECT} 2>&1 | sed 's/^/pip: /'
PYTHONPATH=/tmp/pkgs python3 -c "import covey_demo; print('IMPORTED', covey_demo.WORD)"
"""
GRANT = {"repositories": ["acme/app"], "force_push": True}  # deleting is not granted


def script(remote: str, agent: str, connection: str, more: str = "") -> str:
    """What the agent does, each outcome said in the log; then it looks for credentials."""
    branch = f"refs/heads/covey/{agent}/work"
    api = f"$COVEY_API_{connection.upper()}"
    pull = f'{{"title": "Work", "head": "covey/{agent}/work", "base": "main"}}'
    return f"""
set -u
cd "$HOME"
git clone -q {remote}/acme/app.git app && echo "CLONED"
cd app
git -c user.name=Agent -c user.email=agent@covey.test commit -q --allow-empty -m work
git push -q origin HEAD:{branch} && echo "PUSHED $(git rev-parse HEAD)"
git push origin HEAD:main 2>&1 | sed 's/^/main: /'
git -c user.name=Agent -c user.email=agent@covey.test commit -q --amend --allow-empty -m again
git push -q --force origin HEAD:{branch} && echo "FORCED $(git rev-parse HEAD)"
git push origin :{branch} 2>&1 | sed 's/^/delete: /'
git clone -q {remote}/acme/secret.git secret 2>&1 | sed 's/^/secret: /'
echo "api: {api}"
curl -sS -H "Authorization: Bearer $COVEY_TOKEN" -d '{pull}' {api}/repos/acme/app/pulls \\
    | sed 's/^/pull: /'; echo
curl -sS -X PUT -H "Authorization: Bearer $COVEY_TOKEN" {api}/repos/acme/app/pulls/1/merge \\
    | sed 's/^/merge: /'; echo
{more}
env | sort
ps -eo args
# What to look for, given encoded: the script is in a process's command line too.
echo {NEEDLES} | base64 -d > /tmp/needles
grep -rlF -f /tmp/needles --exclude=needles / --exclude-dir=proc --exclude-dir=sys 2>/dev/null \\
    || echo "no credential in its files"
cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' \\
    | grep -cF -f /tmp/needles || echo "no credential in its processes"
"""


@pytest.fixture
def stand_in(tmp_path: Path, ca) -> Iterator[tuple[GitHost, GitHub, str, Index, str]]:  # noqa: F811
    """A git host with acme/app and acme/secret, and GitHub's API beside it, on loopback; and
    a private package index."""
    host = GitHost(tmp_path / "host", SECRET)
    host.repository("acme/app")
    host.repository("acme/secret")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    github = GitHub(key, tokens=host.minted)
    github.also.add(SECRET)  # the access token's connection calls the API with it too
    servers = Servers()
    try:
        app = web.Application()
        github.routes(app)
        app.router.add_route("*", "/{tail:.*}", host.handle)
        port = servers.serve(app, ca.issue("127.0.0.1"))
        index = Index("deploy", INDEX_PASSWORD)
        packages = web.Application()
        index.routes(packages)
        index_port = servers.serve(packages, ca.issue("127.0.0.1"))
        yield host, github, f"https://127.0.0.1:{port}", index, f"https://127.0.0.1:{index_port}"
    finally:
        servers.close()


def check_the_flow(log: str, host: GitHost, github: GitHub, agent: str, remote: str) -> None:
    branch = f"covey/{agent}/work"
    assert "CLONED" in log, log
    pushed = log.split("PUSHED ", 1)[1].split()[0]
    forced = log.split("FORCED ", 1)[1].split()[0]
    assert host.ref("acme/app", branch) == forced != pushed  # the stand-in shows the commit
    assert host.ref("acme/app", "main") not in (pushed, forced)
    assert "main: remote: covey: protected by covey: the default branch (HEAD)" in log
    assert "main:  ! [remote rejected] HEAD -> main (protected by covey" in log
    assert "delete: remote: covey: refused by covey: the grant does not allow deleting" in log
    assert "secret: remote: covey: repository acme/secret not found" in log
    assert not [seen for seen in host.seen if "secret" in seen.path]  # never asked for
    # What the sandbox's git was told, for this run only: the remote leads to the gateway.
    assert f"GIT_CONFIG_VALUE_0={remote}/" in log
    assert "no credential in its files" in log and "no credential in its processes" in log
    assert SECRET not in log and "ghs_minted_" not in log
    # A pull request through the API route; merging it is refused, naming the rule.
    assert '"number": 1' in log.split("pull: ", 1)[1].splitlines()[0]
    assert github.pulls == [{"title": "Work", "head": f"covey/{agent}/work", "base": "main"}]
    merge = log.split("merge: ", 1)[1].splitlines()[0]
    assert '"rule": "call"' in merge and "PUT /repos/acme/app/pulls/1/merge is no call" in merge
    assert not [seen for seen in github.seen if seen[1].endswith("/merge")]
    refused = CredentialedRequest.objects.exclude(refused="").values_list("refused", flat=True)
    assert {r.split(":")[0] for r in refused} >= {"protected by covey", "not granted"}
    assert any(r.startswith("PUT /repos/acme/app/pulls/1/merge is no call") for r in refused)


def test_a_sandbox_clones_and_pushes_within_its_grant_holding_no_credential(
    tmp_path,
    workplace_image,
    acme,
    alice,
    vendor,  # noqa: F811
    ca,  # noqa: F811
    stand_in,
):
    host, github, remote, index, index_url = stand_in
    services.create_connection(
        acme, "forge", "token", SECRET, git_url=remote, api_url=remote, scheme="basic",
        username="x-access-token",
    )  # fmt: skip
    services.create_connection(
        acme, "index", "basic", INDEX_PASSWORD, index_url=index_url, username="deploy",
        paths=["/simple/", "/packages/"],
    )  # fmt: skip
    address = Engine("address").bridge_address(None)  # where sandboxes reach this host
    with start_gateway(tmp_path, vendor, ca, host=address) as gateway:
        stack = Stack(tmp_path, workplace_image, COVEY_MODEL_GATEWAY_URL=gateway.url)
        try:
            runner, config = stack.register(acme, "edge-git")
            agent = stack.agent(
                acme, "Pusher", ["sh", "-c", script(remote, "pusher", "forge", PIP)],
                credential_grants=[{"connection": "forge", **GRANT}, {"connection": "index"}],
            )  # fmt: skip
            with stack.runner(runner, config):
                run = run_services.queue_run(agent, "push your branch")
                stack.wait(run, *FINISHED, timeout=120)
            with stack.api(alice) as api:
                log = api.get(f"/api/v1/runs/{run.pk}/log/").text
        finally:
            stack.close()
        assert SECRET not in gateway.output()
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, log)
    check_the_flow(log, host, github, "pusher", remote)
    assert {r.run_id for r in CredentialedRequest.objects.all()} == {run.pk}
    # pip read the private index through the gateway, told of it by the run's environment.
    assert f"IMPORTED {WORD}" in log and "COVEY_REGISTRY_INDEX=http://covey:" in log
    assert "PIP_EXTRA_INDEX_URL" not in log  # no index beside the public one (confusion)
    assert [path for _, path, _ in index.seen] == [f"/simple/{PROJECT}/", f"/packages/{WHEEL}"]
    assert INDEX_PASSWORD not in log


def test_under_hard_isolation_a_github_app_s_minted_tokens_stay_in_the_gateway(
    tmp_path,
    workplace_image,
    egress_image,  # noqa: F811 - the fixture imported above
    acme,
    alice,
    vendor,  # noqa: F811
    ca,  # noqa: F811
    stand_in,
):
    runner_ids_apart()
    host, github, remote, index, index_url = stand_in
    services.create_connection(
        acme, "github", "github-app", pem(github.key), git_url=remote, api_url=remote,
        app_id="12", installation_id="34",
    )  # fmt: skip
    services.create_connection(
        acme, "index", "basic", INDEX_PASSWORD, index_url=index_url, username="deploy",
        paths=["/simple/", "/packages/"],
    )  # fmt: skip
    keys.set_model_key(acme, KEY)
    address = Engine("address").bridge_address(None)  # what the proxy container reaches
    with start_gateway(tmp_path, vendor, ca, host=address) as gateway:
        world = World(tmp_path, workplace_image, egress_image, COVEY_MODEL_GATEWAY_URL=gateway.url)
        try:
            runner, config = world.register(acme, "isolated-git")
            # Its allowlist names nothing on this machine: the gateway is allowed as built in.
            agent = world.stack.agent(
                acme, "Isolated pusher",
                ["sh", "-c", script(remote, "isolated-pusher", "github", PIP)],
                credential_grants=[{"connection": "github", **GRANT}, {"connection": "index"}],
            )  # fmt: skip
            budget_services.set_budget(agent, Decimal(5))
            with world.stack.runner(runner, config, **world.runner_env()):
                run = world.stack.wait(
                    run_services.queue_run(agent, "push your branch"), *FINISHED, timeout=120
                )
            with world.stack.api(alice) as api:
                log = api.get(f"/api/v1/runs/{run.pk}/log/").text
        finally:
            world.close()
        assert "ghs_minted_" not in gateway.output()
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, log)
    assert "HTTP_PROXY=http://" in log  # the gateway was reached through the proxy
    check_the_flow(log, host, github, "isolated-pusher", remote)
    assert f"IMPORTED {WORD}" in log  # pip read the private index through the proxy too
    assert [path for _, path, _ in index.seen] == [f"/simple/{PROJECT}/", f"/packages/{WHEEL}"]
    # A token for git and one for the API, each for the repository and what it needs.
    assert github.minted == [
        {"repositories": ["app"], "permissions": {"metadata": "read", "contents": "write"}},
        {
            "repositories": ["app"],
            "permissions": {
                "metadata": "read",
                "contents": "read",
                "pull_requests": "write",
                "issues": "write",
            },
        },
    ]
    assert host.seen[-1].headers["Authorization"] != host.authorization
