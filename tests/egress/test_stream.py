"""The policy stream, end to end: the real stream process over PostgreSQL's notices, the control
plane (gunicorn) that names it, and a runner host's proxy (no database) that follows it.

Each proxy here polls every 30 s, so a change enforced within a second came by the stream."""

import time
from contextlib import ExitStack

import httpx
import pytest

from agents import services as agent_services
from approvals import services as approvals
from egress.services import issue_token
from runners.services import create_registration_token, register_runner
from templates.models import AllowlistTemplate
from tests.egress.conftest import connect, start_proxy, subprocess_database_url
from tests.processes import control_plane, free_port, policy_stream, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

NO_DATABASE = "postgres://nobody@127.0.0.1:1/no-database-here"


def followers(stream_url: str) -> int:
    base = stream_url.split("/api/")[0]
    try:
        answer = httpx.get(f"{base}/readyz", timeout=5)
    except httpx.HTTPError:
        return -1
    return answer.json().get("followers", -1) if answer.status_code == 200 else -1


def seconds_until(condition, most: float) -> float:
    """How long until condition() held (checked every 10 ms), or fail after ``most`` s."""
    began = time.monotonic()
    while time.monotonic() - began < most:
        if condition():
            return time.monotonic() - began
        time.sleep(0.01)
    raise AssertionError(f"not within {most} s")


def runner_proxy(stack, tmp_path, net, url, token, **env):
    return stack.enter_context(
        start_proxy(
            tmp_path,
            net,
            DATABASE_URL=NO_DATABASE,
            EXTRA_ARGS=f"--control-plane {url} --runner-token {token}",
            **env,
        )
    )


def test_an_approval_reaches_a_runner_proxy_through_the_stream_within_a_second(
    net, tmp_path, acme, globex, april
):
    target = f"good.test:{net.tls.port}"
    agent = agent_services.create_agent(acme, "builder", allowlist=[])
    _, credentials = issue_token(agent)
    _, secret = create_registration_token(acme)
    _, token = register_runner(secret, "edge-1", [])
    other = agent_services.create_agent(globex, "builder", allowlist=[target])
    _, their_credentials = issue_token(other)
    database = subprocess_database_url()
    with ExitStack() as stack:
        stream = stack.enter_context(policy_stream(tmp_path, database))
        url = stack.enter_context(control_plane(tmp_path, database, COVEY_EGRESS_STREAM_URL=stream))
        status = f"127.0.0.1:{free_port()}"
        proxy = runner_proxy(
            stack,
            tmp_path,
            net,
            url,
            token,
            COVEY_EGRESS_POLICY_POLL="30",
            COVEY_EGRESS_POLICY_GRACE="60",
            COVEY_EGRESS_STATUS_LISTEN=status,
            COVEY_METRICS_TOKEN="m" * 32,
        )
        wait_for(lambda: followers(stream) == 1, 15, "the proxy following the stream")
        scraped = httpx.get(
            f"http://{status}/metrics", headers={"Authorization": "Bearer " + "m" * 32}
        )
        assert "covey_egress_policy_streaming 1.0" in scraped.text
        refused = connect(proxy, target, credentials)
        assert refused.headers["x-covey-deny-reason"] == "not-on-allowlist"

        request = approvals.file_egress(agent, target, reason="the build needs it")
        approvals.approve(request, by=april, note="fine")
        took = seconds_until(lambda: connect(proxy, target, credentials).status == 200, 5)
        assert took < 1.0, f"the approval took {took:.2f} s to reach the proxy"

        agent_services.update_agent(agent, enabled=False)
        took = seconds_until(lambda: connect(proxy, target, credentials).status == 403, 5)
        assert took < 1.0, f"disabling took {took:.2f} s to reach the proxy"

        # A token issued now works at its first request (a run's first request comes moments
        # after its token is issued): its delta came, or the proxy asked the stream's barrier.
        agent_services.update_agent(agent, enabled=True)
        for _ in range(5):
            _, fresh = issue_token(agent)
            assert connect(proxy, target, fresh).status == 200
        # The barrier names a generation that holds a change committed just before it.
        runner = {"Authorization": f"Runner {token}"}
        before = httpx.get(f"{stream}sync/", headers=runner, timeout=5).json()["generation"]
        agent_services.update_agent(agent, allowlist=[target, "more.test"])
        after = httpx.get(f"{stream}sync/", headers=runner, timeout=5).json()["generation"]
        assert after != before
        assert httpx.get(f"{stream}sync/", headers=runner, timeout=5).json()["generation"] == after
        # A template's entries changed: its one list, as soon.
        mirror = AllowlistTemplate.objects.create(slug="mirror", name="Mirror", entries=[])
        agent_services.update_agent(agent, allowlist=[], templates=[mirror])
        seconds_until(lambda: connect(proxy, target, credentials).status == 403, 5)
        mirror.entries = [target]
        mirror.save()
        took = seconds_until(lambda: connect(proxy, target, credentials).status == 200, 5)
        assert took < 1.0, f"a template's change took {took:.2f} s to reach the proxy"
        # Another organisation's agents are never this runner's proxy's.
        assert connect(proxy, target, their_credentials).status == 407
        assert "following the egress policy stream" in proxy.output()


def test_a_runner_proxy_polls_while_the_stream_is_away_and_follows_it_when_back(
    net, tmp_path, acme
):
    target = f"good.test:{net.tls.port}"
    agent = agent_services.create_agent(acme, "builder", allowlist=[target])
    _, credentials = issue_token(agent)
    _, secret = create_registration_token(acme)
    _, token = register_runner(secret, "edge-1", [])
    database = subprocess_database_url()
    port = free_port()
    with ExitStack() as stack:
        away = stack.enter_context(ExitStack())
        stream = away.enter_context(policy_stream(tmp_path, database, port=port))
        url = stack.enter_context(control_plane(tmp_path, database, COVEY_EGRESS_STREAM_URL=stream))
        proxy = runner_proxy(
            stack, tmp_path, net, url, token, COVEY_EGRESS_POLICY_POLL="1"
        )  # fmt: skip
        wait_for(lambda: followers(stream) == 1, 15, "the proxy following the stream")
        assert connect(proxy, target, credentials).status == 200

        away.close()  # the stream stops: the proxy polls (tests/egress/test_remote.py: polls
        # keep a policy trusted past the grace period)
        wait_for(lambda: "policy stream is away" in proxy.output(), 10, "the proxy noticing")
        agent_services.update_agent(agent, enabled=False)
        wait_for(lambda: connect(proxy, target, credentials).status == 403, 5, "a polled change")
        answer = connect(proxy, target, credentials)
        assert answer.headers["x-covey-deny-reason"] == "agent-disabled"

        # Back: the proxy follows it again, and changes come within a second.
        stream = stack.enter_context(policy_stream(tmp_path, database, port=port))
        wait_for(lambda: followers(stream) == 1, 15, "the proxy following the stream again")
        agent_services.update_agent(agent, enabled=True)
        took = seconds_until(lambda: connect(proxy, target, credentials).status == 200, 5)
        assert took < 1.0, f"the change took {took:.2f} s once the stream was back"


def test_the_stream_refuses_what_is_no_runners_token_and_shows_metrics_to_their_bearer(
    tmp_path, acme
):
    database = subprocess_database_url()
    with policy_stream(tmp_path, database, COVEY_METRICS_TOKEN="m" * 32) as stream:
        assert httpx.get(stream, timeout=5).status_code == 401
        headers = {"Authorization": "Runner covey-run-no"}
        answer = httpx.get(stream, headers=headers, params={"v": "2"}, timeout=5)
        assert answer.status_code == 401
        assert answer.json() == {"detail": "unknown runner token"}
        # A proxy of before shared lists is told so, and polls (its form is served there).
        answer = httpx.get(stream, headers=headers, timeout=5)
        assert answer.status_code == 400 and "?v=2" in answer.json()["detail"]
        base = stream.split("/api/")[0]
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 401
        metrics = httpx.get(
            f"{base}/metrics", headers={"Authorization": "Bearer " + "m" * 32}, timeout=5
        )
        assert metrics.status_code == 200
        assert "covey_stream_followers 0.0" in metrics.text
        assert "covey_stream_listening 1.0" in metrics.text
