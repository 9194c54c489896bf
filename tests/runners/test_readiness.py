"""What runner hosts and their proxies tell the control plane about themselves, and where people
see it: a heartbeat carries whether the runner can take work (and why not), a proxy's policy
poll marks the proxy seen (not the runner), and the admin, dashboard, API and metrics show
both. The host's side is tests/runners/test_host_status.py."""

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from runners.models import Runner
from runners.protocol import MAX_PROBLEM_CHARS
from tests.factories import online_runner

pytestmark = pytest.mark.django_db

PROBLEM = "the Docker engine does not answer: connection refused"


@pytest.fixture
def edge(acme):
    runner, token = online_runner(acme)
    return runner, APIClient(HTTP_AUTHORIZATION=f"Runner {token}")


def beat(client, **body):
    return client.post("/api/v1/runner/", body, format="json")


def test_a_heartbeat_records_whether_the_runner_can_take_work_and_why_not(edge):
    runner, client = edge
    assert beat(client, isolation="cooperative").status_code == 200
    runner.refresh_from_db()
    assert (runner.host_ready, runner.host_problem) == (None, "")  # an older host: not said

    assert beat(client, isolation="cooperative", ready=False, problem=PROBLEM).status_code == 200
    runner.refresh_from_db()
    assert (runner.host_ready, runner.host_problem) == (False, PROBLEM)

    assert beat(client, ready=True, problem="").status_code == 200
    runner.refresh_from_db()
    assert (runner.host_ready, runner.host_problem) == (True, "")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"ready": True}, "Send 'ready' and 'problem' together"),
        ({"problem": PROBLEM}, "Send 'ready' and 'problem' together"),
        ({"ready": True, "problem": PROBLEM}, "'ready' is true exactly when 'problem' is empty"),
        ({"ready": False, "problem": ""}, "'ready' is true exactly when 'problem' is empty"),
        ({"ready": False, "problem": "x" * (MAX_PROBLEM_CHARS + 1)}, "no more than 1000"),
    ],
)
def test_a_heartbeat_that_contradicts_itself_is_refused_and_changes_nothing(edge, body, says):
    runner, client = edge
    beat(client, ready=False, problem=PROBLEM)
    answer = beat(client, **body)
    assert answer.status_code == 400
    assert says in str(answer.json())
    runner.refresh_from_db()
    assert (runner.host_ready, runner.host_problem) == (False, PROBLEM)


def test_a_proxy_polling_its_policy_marks_the_proxy_seen_not_the_runner(edge):
    """A runner host that died while its proxy polls on is not online (it was, before)."""
    runner, client = edge
    long_ago = timezone.now() - timedelta(hours=1)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=long_ago)
    assert client.get("/api/v1/egress/policy/").status_code == 200
    runner.refresh_from_db()
    assert runner.last_seen_at == long_ago and not runner.online
    assert runner.proxy_seen_at is not None
    assert timezone.now() - runner.proxy_seen_at < timedelta(minutes=1)

    assert beat(client).status_code == 200  # the host's own call
    runner.refresh_from_db()
    assert runner.online


def test_people_see_it_in_the_api_the_admin_and_the_dashboard(edge, operator_client, root):
    runner, client = edge
    beat(client, ready=False, problem=PROBLEM)
    client.get("/api/v1/egress/policy/")

    listed = operator_client.get("/admin/runners/runner/").content.decode()
    assert "not ready" in listed and PROBLEM in listed
    page = operator_client.get(f"/admin/runners/runner/{runner.pk}/change/").content.decode()
    assert PROBLEM in page and "Proxy seen at" in page
    dashboard = operator_client.get("/admin/").content.decode()
    assert f"not ready: {PROBLEM}" in dashboard

    api = APIClient()
    api.force_authenticate(root)
    shown = api.get(f"/api/v1/runners/{runner.pk}/").json()
    assert shown["host_ready"] is False and shown["host_problem"] == PROBLEM
    assert shown["proxy_seen_at"] is not None

    beat(client, ready=True, problem="")
    listed = operator_client.get("/admin/runners/runner/").content.decode()
    assert "not ready" not in listed and ">ready<" in listed


def test_the_control_planes_metrics_say_which_runners_are_ready(edge, client, settings):
    _, runner_client = edge
    settings.COVEY_METRICS_TOKEN = token = "scrape-" + "t" * 32
    beat(runner_client, ready=False, problem=PROBLEM)
    runner_client.get("/api/v1/egress/policy/")
    answer = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    samples = {
        (sample.name, sample.labels["runner"]): sample.value
        for family in text_string_to_metric_families(answer.content.decode())
        for sample in family.samples
        if family.name.startswith("covey_runner_")
    }
    ready = {
        name: value for (metric, name), value in samples.items() if metric == "covey_runner_ready"
    }
    assert ready == {"edge-1": 0}  # the built-in runner's host has not said
    seen = samples["covey_runner_proxy_last_seen_timestamp_seconds", "edge-1"]
    assert abs(seen - timezone.now().timestamp()) < 60


def test_a_proved_runner_whose_host_cannot_take_work_is_not_said_to_have_failed_its_probe(
    edge, operator_client, client, settings
):
    """Hard isolation, a probe passed, then the host's engine went: no work for it, and what
    people see says why (not ready), not that its probe failed."""
    from runners.models import Probe, ProbeStatus

    runner, runner_client = edge
    probe = Probe.objects.create(runner=runner, status=ProbeStatus.PASSED, isolation="network")
    Runner.objects.filter(pk=runner.pk).update(isolation="network", last_probe=probe)
    beat(runner_client, isolation="network", ready=False, problem=PROBLEM)
    runner.refresh_from_db()
    assert runner.probe_passed and not runner.trusted
    assert runner.untrusted_reason() == f"cannot take work now: {PROBLEM}"
    dashboard = operator_client.get("/admin/").content.decode()
    assert f"not ready: {PROBLEM}" in dashboard and "probe failed" not in dashboard
    settings.COVEY_METRICS_TOKEN = token = "scrape-" + "t" * 32
    answer = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}").content.decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(answer)
        for sample in family.samples
        if sample.labels.get("runner") == "edge-1"
    }
    assert (samples["covey_runner_probe_passed"], samples["covey_runner_ready"]) == (1, 0)
