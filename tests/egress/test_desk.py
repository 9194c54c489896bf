"""The proxy's request desk (egress/proxy/desk.py) with the real proxy command, and
covey-request (egress/sandbox/covey_request.py) as the client a sandbox runs: a refused route is
asked for, decided, and then reached through the same live proxy."""

import json
from contextlib import ExitStack

import httpx
import pytest
from django.db import connection

from approvals import services as approvals
from approvals.models import Request
from egress.models import Decision
from egress.sandbox import covey_request
from tests.egress.conftest import basic, connect, send, start_proxy, subprocess_database_url
from tests.factories import online_runner
from tests.processes import control_plane, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def ask(monkeypatch, capsys, proxy, credentials, *argv):
    monkeypatch.setenv("HTTP_PROXY", proxy.url(credentials))
    monkeypatch.delenv("http_proxy", raising=False)
    code = covey_request.main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_a_refused_route_is_asked_for_decided_and_then_reached(
    proxy, net, world, monkeypatch, capsys, root
):
    agent, credentials = world
    target = f"other.test:{net.tls.port}"
    with (
        httpx.Client(proxy=proxy.url(credentials), verify=net.ca.client_context()) as http,
        pytest.raises(httpx.ProxyError) as refused,
    ):
        http.get(f"https://{target}/")
    assert "403" in str(refused.value)
    # What the refusal says: the command to run, exactly.
    answered = connect(proxy, target, credentials)
    assert answered.status == 403
    said = answered.body.decode()
    assert f'covey-request egress {target} --reason "why the agent needs it"' in said
    refusals = Decision.objects.filter(agent=agent, allowed=False, host="other.test")
    wait_for(refusals.exists, 10, "the refusals in the decision log")  # written in batches

    code, answer = ask(monkeypatch, capsys, proxy, credentials,
                       "egress", target, "--reason", "the test upstream")  # fmt: skip
    assert (code, answer["status"], answer["what"]) == (3, "pending", target)
    request = Request.objects.get(pk=answer["id"])
    (asked,) = request.requesters.all()
    assert (asked.agent, asked.reason) == (agent, "the test upstream")
    assert asked.refusal == refusals.latest("decided_at")

    approvals.approve(request, by=root, note="it is the test's own")
    proxy.sync()
    code, answer = ask(monkeypatch, capsys, proxy, credentials, "status", str(request.pk))
    assert (code, answer["decision"], answer["note"]) == (0, "approved", "it is the test's own")
    assert answer["changed"] == {"agent_versions": {str(agent.pk): agent.version + 1}}
    with httpx.Client(proxy=proxy.url(credentials), verify=net.ca.client_context()) as http:
        assert http.get(f"https://{target}/").status_code == 200  # the same route, now allowed


def test_the_desk_knows_only_credentials_of_live_agents(proxy, net, world, monkeypatch, capsys):
    _agent, credentials = world
    username = credentials.split(":")[0]
    for who in (None, f"{username}:not-the-token"):
        auth = f"Proxy-Authorization: {basic(who)}\r\n" if who else ""
        raw = (
            "POST http://requests.covey.invalid/v1/requests HTTP/1.1\r\n"
            f"Host: requests.covey.invalid\r\nContent-Length: 2\r\n{auth}\r\n{{}}"
        )
        answered = send(proxy, raw.encode())
        reason = answered.headers.get("x-covey-deny-reason")
        assert (answered.status, reason) == (407, "proxy-auth-required")
    assert Request.objects.count() == 0
    code, answer = ask(monkeypatch, capsys, proxy, credentials,
                       "package", "apt", "jq", "--reason", "x")  # fmt: skip
    assert code == 2 and "the agent has no workplace" in answer["detail"]
    code, answer = ask(monkeypatch, capsys, proxy, credentials, "status", "999999")
    assert code == 2 and "made no request 999999" in answer["detail"]


def test_something_already_allowed_is_answered_at_once(proxy, net, world, monkeypatch, capsys):
    _agent, credentials = world
    code, answer = ask(monkeypatch, capsys, proxy, credentials,
                       "egress", f"good.test:{net.tls.port}", "--reason", "x")  # fmt: skip
    assert (code, answer["decision"]) == (0, "approved")
    assert answer["note"] == "already allowed (agent)"


def test_covey_request_waits_for_the_decision(proxy, net, world, monkeypatch, capsys, root):
    import threading

    _agent, credentials = world

    def decide_soon():
        try:
            wait_for(lambda: Request.objects.filter(status="pending").exists(), 10, "the request")
            approvals.reject(Request.objects.get(), by=root, note="use the mirror")
        finally:
            connection.close()  # this thread's own

    decider = threading.Thread(target=decide_soon)
    decider.start()
    code, answer = ask(monkeypatch, capsys, proxy, credentials,
                       "egress", "evil.test", "--reason", "x", "--wait", "20")  # fmt: skip
    decider.join()
    assert (code, answer["decision"], answer["note"]) == (1, "rejected", "use the mirror")


def file_raw(proxy, credentials, body: bytes):
    """POST ``body`` as it is to the desk, through the proxy: (status, JSON answer)."""
    head = (
        "POST http://requests.covey.invalid/v1/requests HTTP/1.1\r\n"
        "Host: requests.covey.invalid\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nProxy-Authorization: {basic(credentials)}\r\n\r\n"
    )
    answered = send(proxy, head.encode() + body)
    answered.sock.close()
    return answered.status, json.loads(answered.body)


FILING = '{"kind": "egress", "target": "pypi.org", %s}'
# (the body, the field it names, what it says): each was a 503 "try again" (NaN and lone
# surrogates: the proxy could not pass them on), a 201 keeping a repr ("{'evil': ['x']}"), or
# silently dropped (an unknown field).
HOSTILE = [
    (FILING % '"reason": NaN', "reason", "not a finite number"),
    (FILING % '"reason": -Infinity', "reason", "not a finite number"),
    (FILING % '"reason": 1e999', "reason", "not a finite number"),
    (FILING % '"reason": "why \\ud800"', "reason", "a lone surrogate (\\ud800)"),
    (FILING % '"reason": "x", "\\udfff": 1', "\\udfff", "a lone surrogate (\\udfff)"),
    (FILING % f'"reason": {"[" * 5000}{"]" * 5000}', "reason", "nested deeper than 64 levels"),
    (FILING % '"reason": {"evil": ["x"]}', "reason", "Not a valid string."),
    (FILING % '"reason": ["x"]', "reason", "Not a valid string."),
    (FILING % '"reason": "x", "scope": "org"', "scope", "Unknown field; the fields are: "),
]


def test_hostile_filings_are_a_400_naming_the_field_through_either_proxy(
    proxy, net, world, tmp_path, django_db_setup
):
    agent, credentials = world
    _, runner_token = online_runner(agent.organisation)
    with ExitStack() as stack:
        url = stack.enter_context(control_plane(tmp_path, subprocess_database_url()))
        remote = stack.enter_context(
            start_proxy(
                tmp_path,
                net,
                DATABASE_URL="postgres://nobody@127.0.0.1:1/no-database-here",
                EXTRA_ARGS=f"--control-plane {url} --runner-token {runner_token}",
            )
        )
        target = f"good.test:{net.tls.port}"
        wait_for(lambda: connect(remote, target, credentials).status == 200, 30, "the policy")
        # The control-plane host's proxy files through the database, a runner's through the
        # control plane's API: one validation for both.
        for desk in (proxy, remote):
            for body, field, said in HOSTILE:
                status, answer = file_raw(desk, credentials, body.encode())
                assert status == 400, (desk.port, body[:80], answer)
                assert any(said in told for told in answer[field]), (body[:80], answer)
                assert f"{field}: " in answer["detail"], answer
            status, answer = file_raw(desk, credentials, (FILING % '"reason": "the SDK"').encode())
            assert (status, answer["status"]) == (201, "pending"), answer
    (filed,) = Request.objects.all()
    assert [r.reason for r in filed.requesters.all()] == ["the SDK", "the SDK"]
