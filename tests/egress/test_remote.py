"""A proxy on a runner host: no database, policy and log through the control plane's API."""

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack

import pytest

from agents import services as agent_services
from egress.models import Decision
from egress.services import issue_token
from runners.host import sealing
from runners.services import create_registration_token
from tests.egress.conftest import connect, start_proxy, subprocess_database_url
from tests.factories import OrganisationFactory
from tests.processes import ROOT, control_plane, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# A runner host has no database: anything that tried to use this would fail loudly.
NO_DATABASE = "postgres://nobody@127.0.0.1:1/no-database-here"


def register(url, secret, tmp_path):
    config = tmp_path / "runner.json"
    env = {**os.environ, "DATABASE_URL": NO_DATABASE}
    args = [sys.executable, "manage.py", "runner_register", "--url", url,
            "--registration-token", secret, "--name", "edge-1", "--label", "EU",
            "--config", str(config)]  # fmt: skip
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "Registered runner 'edge-1'" in result.stdout
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    return json.loads(config.read_text())


@pytest.mark.e2e  # a control plane of its own
def test_a_runner_proxy_enforces_its_organisations_policy_without_a_database(
    net, tmp_path, django_db_setup
):
    acme, globex = OrganisationFactory(name="Acme"), OrganisationFactory(name="Globex")
    target = f"good.test:{net.tls.port}"
    ours = agent_services.create_agent(acme, "builder", allowlist=[target])
    theirs = agent_services.create_agent(globex, "builder", allowlist=[target])
    _, our_credentials = issue_token(ours)
    _, their_credentials = issue_token(theirs)
    _, secret = create_registration_token(acme)

    with ExitStack() as stack:
        stop_control_plane = stack.enter_context(ExitStack())
        url = stop_control_plane.enter_context(control_plane(tmp_path, subprocess_database_url()))
        runner = register(url, secret, tmp_path)
        assert runner["labels"] == ["eu"]
        env = {
            "DATABASE_URL": NO_DATABASE,
            # Long enough for the control plane's stop (gunicorn's, under a parallel suite).
            "COVEY_EGRESS_POLICY_GRACE": "6",
            "EXTRA_ARGS": f"--control-plane {url} --runner-token {runner['token']}",
        }
        proxy = stack.enter_context(start_proxy(tmp_path, net, **env))
        wait_for(lambda: connect(proxy, target, our_credentials).status == 200, 10, "allow")
        # Another organisation's agent is unknown to this runner's proxy.
        assert connect(proxy, target, their_credentials).status == 407
        # Decisions reach the control plane's log through the API.
        wait_for(
            lambda: Decision.objects.filter(agent=ours, proxy="edge-1").exists(),
            10,
            "the decision in the control plane's log",
        )
        # Live changes arrive through the API too.
        agent_services.update_agent(ours, enabled=False)
        wait_for(lambda: connect(proxy, target, our_credentials).status == 403, 2, "the change")
        agent_services.update_agent(ours, enabled=True)
        wait_for(lambda: connect(proxy, target, our_credentials).status == 200, 2, "again")

        # The control plane goes away: the proxy keeps its last policy for the grace period,
        # then refuses everything.
        stopped = time.monotonic()  # before: it may refuse polls while it shuts down
        stop_control_plane.close()
        assert connect(proxy, target, our_credentials).status == 200
        wait_for(
            lambda: connect(proxy, target, our_credentials).status == 503, 15, "failing closed"
        )
        assert time.monotonic() - stopped >= 5.5
        answer = connect(proxy, target, our_credentials)
        assert answer.headers["x-covey-deny-reason"] == "policy-unavailable"


def test_the_policy_endpoint_needs_a_runner_token(client, acme):
    assert client.get("/api/v1/egress/policy/").status_code in (401, 403)
    response = client.get("/api/v1/egress/policy/", HTTP_AUTHORIZATION="Runner covey-run-no")
    assert response.status_code == 401


@pytest.mark.e2e  # a control plane of its own
def test_a_runner_proxy_follows_its_runners_renewed_token(
    net, tmp_path, django_db_setup, monkeypatch
):
    """The runner host rewrites its file when it takes a renewed token; the proxy reads it.
    (The order's way through the broker is tested end to end in tests/runners/test_runs.py.)"""
    from runners import dispatch
    from runners.host.identity import Identity
    from runners.host.runner import HostSettings, RunnerHost
    from runners.services import register_runner, renew_runner_tokens

    acme = OrganisationFactory(name="Acme")
    target = f"good.test:{net.tls.port}"
    agent = agent_services.create_agent(acme, "builder", allowlist=[target])
    _, credentials = issue_token(agent)
    _, secret = create_registration_token(acme)
    runner, token = register_runner(secret, "edge-1", [])
    with ExitStack() as stack:
        url = stack.enter_context(control_plane(tmp_path, subprocess_database_url()))
        config = tmp_path / "runner.json"
        config.write_text(json.dumps({"url": url, "id": runner.pk, "token": token}))
        env = {
            "DATABASE_URL": NO_DATABASE,
            "COVEY_EGRESS_POLICY_GRACE": "2",
            "EXTRA_ARGS": f"--runner-config {config}",
        }
        proxy = stack.enter_context(start_proxy(tmp_path, net, **env))
        wait_for(lambda: connect(proxy, target, credentials).status == 200, 10, "allow")
        orders = []  # the sealed orders, as the runner's queue would carry them
        monkeypatch.setattr(
            dispatch,
            "send_token",
            lambda r, old, new: orders.append((r.pk, sealing.seal(old, new))),
        )
        renew_runner_tokens()
        identity = Identity(config)
        host = RunnerHost({identity.id: identity}, HostSettings(homes=tmp_path / "homes"))
        for runner_id, sealed in orders:
            if runner_id == runner.pk:
                host.renew_token(runner_id, sealed)  # what the order does on the runner host
        assert json.loads(config.read_text())["token"] != token
        agent_services.update_agent(agent, enabled=False)
        wait_for(lambda: connect(proxy, target, credentials).status == 403, 3, "the change")
        time.sleep(2.5)  # past the grace period: the proxy still has a working source
        assert connect(proxy, target, credentials).headers["x-covey-deny-reason"] == (
            "agent-disabled"
        )
