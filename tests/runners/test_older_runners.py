"""The runner's bodies on the wire: a runner host one version back (before they were the
dataclasses of runners/protocol.py) sends exactly the JSON written out here, and the control
plane takes it as it did; today's runner sends the same JSON; a body that does not fit is a
400 naming the field, and an answer that does not fit is refused by the runner."""

import uuid

import pytest
from rest_framework.test import APIClient

from egress.environment import Isolation
from runners.host.client import _without_unsaid
from runners.models import Probe, ProbeStatus, Runner
from runners.probe.checks import Result, Verdict
from runners.protocol import (
    FEATURES,
    Heartbeat,
    PauseOrder,
    ProbeBegin,
    ProbePlan,
    ProbeReport,
    ProbeStatusAnswer,
    ProtocolError,
    Registered,
    Registration,
    RunnerInfo,
    RunStart,
)
from runners.services import create_registration_token
from runs import services as runs
from runs.models import RunStatus
from tests.factories import AgentFactory, online_runner

pytestmark = pytest.mark.django_db

PROBLEM = "the Docker engine does not answer"
CHECK = {
    "category": "internet",
    "target": "tcp 192.0.2.1:443",
    "verdict": "ok",
    "observed": "blocked (no answer in 2 s)",
}
# What runners/host/client.py sent before its bodies were dataclasses, call by call.
OLD_HEARTBEATS = [
    {},  # no isolation said, readiness not said
    {"isolation": "network"},
    {"isolation": "cooperative", "ready": False, "problem": PROBLEM},
    {"isolation": "network", "ready": True, "problem": ""},
]
OLD_PAUSE = {"paused": True}
OLD_PROBE_BEGIN = {"probe": None, "isolation": "cooperative", "reason": "runner start"}
OLD_PROBE_REPORT = {"checks": [CHECK], "detail": ""}
OLD_START = {"features": ["workplaces"]}


@pytest.fixture
def edge(acme):
    runner, token = online_runner(acme)
    return runner, APIClient(HTTP_AUTHORIZATION=f"Runner {token}")


def test_todays_runner_sends_the_very_bodies_an_older_one_sent():
    """So a control plane one version back reads a new runner too."""
    assert _without_unsaid(Heartbeat()) == OLD_HEARTBEATS[0]
    assert _without_unsaid(Heartbeat(Isolation.NETWORK)) == OLD_HEARTBEATS[1]
    assert _without_unsaid(Heartbeat(Isolation.COOPERATIVE, False, PROBLEM)) == OLD_HEARTBEATS[2]
    assert _without_unsaid(Heartbeat(Isolation.NETWORK, True, "")) == OLD_HEARTBEATS[3]
    assert PauseOrder(True).to_json() == OLD_PAUSE
    assert ProbeBegin(Isolation.COOPERATIVE, None, "runner start").to_json() == OLD_PROBE_BEGIN
    ordered = uuid.uuid4()
    assert ProbeBegin(Isolation.NETWORK, ordered, "ordered").to_json() == {
        "probe": str(ordered),
        "isolation": "network",
        "reason": "ordered",
    }
    result = Result(CHECK["category"], CHECK["target"], Verdict.OK, CHECK["observed"])
    assert ProbeReport((result,)).to_json() == OLD_PROBE_REPORT
    assert RunStart(FEATURES).to_json() == OLD_START
    assert Registration("covey-reg-x", "edge-1", ("eu",)).to_json() == {
        "registration_token": "covey-reg-x",
        "name": "edge-1",
        "labels": ["eu"],
    }


def test_an_older_runners_heartbeats_are_taken_as_before(edge):
    runner, client = edge
    for body in OLD_HEARTBEATS:
        answer = client.post("/api/v1/runner/", body, format="json")
        assert answer.status_code == 200, answer.content
        RunnerInfo.from_json(answer.json())
        runner.refresh_from_db()
        if "isolation" in body:
            assert runner.isolation == body["isolation"]
        if "ready" in body:
            assert (runner.host_ready, runner.host_problem) == (body["ready"], body["problem"])
    assert (runner.isolation, runner.host_ready) == ("network", True)


def test_an_older_runner_pauses_and_resumes_as_before(edge):
    runner, client = edge
    answer = client.post("/api/v1/runner/pause/", OLD_PAUSE, format="json")
    assert answer.status_code == 200 and RunnerInfo.from_json(answer.json()).paused
    answer = client.post("/api/v1/runner/pause/", {"paused": False}, format="json")
    assert answer.status_code == 200 and not RunnerInfo.from_json(answer.json()).paused
    runner.refresh_from_db()
    assert not runner.paused


def test_an_older_runner_begins_and_reports_a_probe_as_before(edge, acme):
    _, client = edge
    AgentFactory(organisation=acme, slug="worker")
    answer = client.post("/api/v1/runner/probes/", OLD_PROBE_BEGIN, format="json")
    assert answer.status_code == 200, answer.content
    plan = ProbePlan.from_json(answer.json())
    assert plan.agent and not plan.error
    probe = Probe.objects.get(pk=plan.probe)
    assert (probe.isolation, probe.reason) == ("cooperative", "runner start")

    answer = client.post(
        f"/api/v1/runner/probes/{plan.probe}/report/", OLD_PROBE_REPORT, format="json"
    )
    assert answer.status_code == 200, answer.content
    assert ProbeStatusAnswer.from_json(answer.json()).status == ProbeStatus.PASSED
    probe.refresh_from_db()
    assert probe.checks == [CHECK]


@pytest.mark.parametrize("body", [OLD_START, None], ids=["features", "from-before-features"])
def test_an_older_runner_starts_a_run_as_before(edge, acme, orders, body):
    _, client = edge
    run = runs.queue_run(AgentFactory(organisation=acme), "x")
    answer = client.post(f"/api/v1/runner/runs/{run.pk}/start/", body, format="json")
    assert answer.status_code == 200, answer.content
    run.refresh_from_db()
    assert run.status == RunStatus.STARTING


def test_an_older_runner_registers_as_before_and_keeps_what_it_kept(client, acme):
    _, secret = create_registration_token(acme)
    body = {"registration_token": secret, "name": "edge-1", "labels": ["eu"]}
    answer = client.post("/api/v1/runners/register/", body, content_type="application/json")
    assert answer.status_code == 201, answer.content
    kept = answer.json()  # an older runner_register saved all of it
    assert {"id", "name", "organisation", "token", "installation", "labels"} <= set(kept)
    registered = Registered.from_json(kept)
    assert Runner.objects.get(pk=registered.id).labels == ["eu"]
    assert registered.token == kept["token"] and registered.installation


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/v1/runner/", {"isolation": "sometimes"}, "isolation"),
        ("/api/v1/runner/", {"ready": "perhaps", "problem": ""}, "ready"),
        ("/api/v1/runner/pause/", {}, "paused"),
        ("/api/v1/runner/pause/", {"paused": "later"}, "paused"),
        ("/api/v1/runner/probes/", {"isolation": "network", "probe": "not-a-uuid"}, "probe"),
        ("/api/v1/runner/probes/", {"reason": "x"}, "isolation"),
    ],
)
def test_it_refuses_a_malformed_runner_body_naming_the_field(edge, path, body, field):
    runner, client = edge
    answer = client.post(path, body, format="json")
    assert answer.status_code == 400
    assert field in answer.json()
    runner.refresh_from_db()
    assert (runner.isolation, runner.paused) == ("", False)


def test_it_refuses_a_malformed_probe_report_or_start_naming_the_field(edge, acme, orders):
    _, client = edge
    AgentFactory(organisation=acme, slug="worker")
    plan = client.post("/api/v1/runner/probes/", OLD_PROBE_BEGIN, format="json").json()
    bad = {"checks": [{**CHECK, "verdict": "fine"}]}
    answer = client.post(f"/api/v1/runner/probes/{plan['probe']}/report/", bad, format="json")
    assert answer.status_code == 400 and "checks" in answer.json()
    assert Probe.objects.get(pk=plan["probe"]).status == ProbeStatus.PENDING

    run = runs.queue_run(AgentFactory(organisation=acme, slug="other"), "x")
    answer = client.post(f"/api/v1/runner/runs/{run.pk}/start/", {"features": 3}, format="json")
    assert answer.status_code == 400 and "features" in answer.json()
    run.refresh_from_db()
    assert run.status == RunStatus.PLACED


def test_a_runner_refuses_a_registration_answer_without_its_token():
    with pytest.raises(ProtocolError, match=r"Registered\.token: missing"):
        Registered.from_json({"id": 1, "name": "edge-1", "organisation": 2})
    with pytest.raises(ProtocolError, match=r"ProbeBegin\.probe: 'x' is not a UUID"):
        ProbeBegin.from_json({"isolation": "network", "probe": "x"})
    with pytest.raises(
        ProtocolError, match=r"Heartbeat\.ready: Send 'ready' and 'problem' together"
    ):
        Heartbeat.from_json({"ready": True})
