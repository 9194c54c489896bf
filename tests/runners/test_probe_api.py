"""Egress probes on the control plane: the runner API that hands out and takes back a probe,
trust and placement, the people's API, the admin and the command. No Docker here: what the
runner sees is written as a runner would report it (tests/runners/test_probe.py runs the real
thing)."""

import io

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from rest_framework.test import APIClient

from egress.models import EgressToken
from runners.checks import check_probe_settings
from runners.models import Probe, ProbeStatus, Runner
from runners.probe import service as probes
from runners.probe.checks import Result, Verdict
from runs import services as runs
from runs.models import Run, RunStatus
from tests.factories import AgentFactory, online_runner

pytestmark = pytest.mark.django_db

OK = Result("internet", "tcp 192.0.2.1:443", Verdict.OK, "blocked (no answer in 2 s)")
LEAK = Result("host", "tcp 10.213.0.1:22", Verdict.LEAK, "connected")


@pytest.fixture
def runner(acme):
    found, token = online_runner(acme)
    return found, APIClient(HTTP_AUTHORIZATION=f"Runner {token}")


def begin(client, probe=None, isolation="network"):
    return client.post(
        "/api/v1/runner/probes/", {"probe": probe, "isolation": isolation}, format="json"
    )


def report(client, probe_id, results, detail=""):
    return client.post(
        f"/api/v1/runner/probes/{probe_id}/report/",
        {"checks": [r.as_dict() for r in results], "detail": detail},
        format="json",
    )


@pytest.mark.postgres  # the services it lists name the database server
def test_a_runner_gets_a_probe_as_the_first_agent_that_may_reach_the_vendor(runner, acme, settings):
    AgentFactory(organisation=acme, slug="locked", enabled=False)
    agent = AgentFactory(organisation=acme, slug="worker")
    found, client = runner

    order = begin(client).json()

    assert order["allowed"] == "api.anthropic.com:443"  # the base list's first entry
    assert order["off_list"] == "example.com:443"
    assert order["agent"] == str(agent)
    username, _, secret = order["credentials"].partition(":")
    assert username == f"{acme.slug}.worker" and secret
    assert order["image"] == "covey-base:trixie"
    database = settings.DATABASES["default"]
    assert {"127.0.0.1:8000", f"{database['HOST']}:{database['PORT']}"} <= set(order["services"])
    probe = Probe.objects.get(pk=order["probe"])
    assert (probe.status, probe.isolation, probe.agent) == ("pending", "network", agent)
    assert probe.egress_token.purpose == f"egress probe {probe.pk}"
    found.refresh_from_db()
    assert (found.isolation, found.trusted) == ("network", False)


def test_a_report_decides_the_runners_trust_and_ends_the_probes_credential(runner, acme):
    AgentFactory(organisation=acme)
    found, client = runner
    first = begin(client).json()

    answer = report(client, first["probe"], [OK, LEAK])

    assert answer.json()["status"] == "failed"
    found.refresh_from_db()
    assert not found.trusted
    assert found.untrusted_reason().startswith("failed its egress probe at ")
    assert "2 checks, 1 leaks, 0 failed; first: host tcp 10.213.0.1:22: connected" in (
        found.untrusted_reason()
    )
    assert not EgressToken.objects.live().exists()

    second = begin(client).json()
    assert report(client, second["probe"], [OK]).json()["status"] == "passed"
    found.refresh_from_db()
    assert found.trusted and found.last_probe_id == found.probes.first().pk
    # A report comes once.
    assert report(client, second["probe"], [OK]).status_code == 404


def test_without_an_agent_the_wall_is_probed_and_the_proxy_checks_are_skipped(runner, acme):
    _, client = runner
    order = begin(client).json()
    assert order["credentials"] == ""
    assert (
        order["no_agent"]
        == f"no enabled agent of {acme.name} may reach api.anthropic.com:443 to probe as"
    )


def test_another_runners_probe_cannot_be_run_or_reported(runner, acme, orders):
    AgentFactory(organisation=acme)
    _, client = runner
    other, _ = online_runner(acme, "edge-2")
    ordered = probes.order_probe(other)

    assert begin(client, str(ordered.pk)).status_code == 409
    assert report(client, ordered.pk, [OK]).status_code == 404
    assert report(client, "not-a-uuid", [OK]).status_code == 404


def test_bad_reports_and_isolations_are_refused(runner, acme):
    _, client = runner
    assert begin(client, isolation="sometimes").status_code == 400
    order = begin(client).json()
    bad = {"category": "host", "target": "x", "verdict": "maybe", "observed": ""}
    answer = client.post(
        f"/api/v1/runner/probes/{order['probe']}/report/", {"checks": [bad]}, format="json"
    )
    assert answer.status_code == 400
    assert Probe.objects.get(pk=order["probe"]).status == "pending"  # nothing half-written


def test_a_probe_the_settings_make_impossible_ends_as_an_error(runner, acme, settings):
    AgentFactory(organisation=acme, allowlist=["example.com"])
    _, client = runner
    order = begin(client).json()  # the only agent may reach the off-list name
    assert order["error"].startswith("the probe cannot run: COVEY_EGRESS_PROBE_OFF_LIST")
    assert Probe.objects.get(pk=order["probe"]).status == ProbeStatus.ERROR


def test_ordering_as_an_agent_that_cannot_do_it_is_refused(acme, orders, settings):
    runner, _ = online_runner(acme)
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="is disabled"):
        probes.order_probe(runner, agent=AgentFactory(organisation=acme, enabled=False))
    settings.COVEY_EGRESS_PROBE_ALLOWED = "vendor.example:443"
    with pytest.raises(ValidationError, match=r"may not reach vendor.example:443"):
        probes.order_probe(runner, agent=AgentFactory(organisation=acme))
    assert orders == [] and not Probe.objects.exists()


def test_a_hard_isolation_runner_gets_work_only_after_a_passing_probe(
    runner, acme, orders, django_capture_on_commit_callbacks
):
    agent = AgentFactory(organisation=acme)
    found, client = runner
    Runner.objects.filter(builtin=True).update(paused=True)
    client.post("/api/v1/runner/", {"isolation": "network"}, format="json")

    run = runs.queue_run(agent, "work")
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert "edge-1 has not passed an egress probe yet" in run.status_detail

    order = begin(client).json()
    with django_capture_on_commit_callbacks(execute=True):
        report(client, order["probe"], [OK])

    assert Run.objects.get(pk=run.pk).status == RunStatus.PLACED  # placed when it passed
    assert ("launch", found.pk, str(run.pk)) in orders


def test_a_cooperative_runner_is_trusted_whatever_its_probe_says(runner, acme):
    found, client = runner
    order = begin(client, isolation="cooperative").json()
    report(client, order["probe"], [LEAK])
    found.refresh_from_db()
    assert found.isolation == "cooperative" and found.trusted


def test_admins_order_probes_through_the_api_and_read_them(
    api, alice, april, acme, orders, django_capture_on_commit_callbacks
):
    AgentFactory(organisation=acme, slug="worker")
    runner, token = online_runner(acme)

    # An approver reads, but does not order.
    assert api(april).post(f"/api/v1/runners/{runner.pk}/probe/", {}).status_code == 403
    api = api(alice)
    with django_capture_on_commit_callbacks(execute=True):
        answer = api.post(f"/api/v1/runners/{runner.pk}/probe/", {"agent": "worker"}, format="json")
    assert answer.status_code == 202, answer.content
    ordered = answer.json()
    assert (ordered["status"], ordered["reason"]) == ("pending", "API")
    assert orders == [("probe", runner.pk, ordered["id"])]

    runner_client = APIClient(HTTP_AUTHORIZATION=f"Runner {token}")
    report(runner_client, begin(runner_client, ordered["id"]).json()["probe"], [OK, LEAK])

    body = api.get(f"/api/v1/runners/{runner.pk}/").json()
    assert body["last_probe"]["status"] == "failed"
    listed = api.get(f"/api/v1/runners/{runner.pk}/probes/").json()["results"]
    assert listed[0]["lines"] == [OK.line(), LEAK.line()]
    assert listed[0]["agent"] == f"{acme.slug}/worker"
    bad = api.post(f"/api/v1/runners/{runner.pk}/probe/", {"agent": "nobody"}, format="json")
    assert bad.status_code == 400 and "no agent" in bad.json()["agent"][0]


def test_the_admin_shows_each_runners_last_probe_and_orders_one(
    client, root, acme, orders, django_capture_on_commit_callbacks
):
    client.force_login(root)
    runner, token = online_runner(acme)
    runner_client = APIClient(HTTP_AUTHORIZATION=f"Runner {token}")
    report(runner_client, begin(runner_client).json()["probe"], [OK, LEAK])

    listing = client.get(reverse("admin:runners_runner_changelist")).content.decode()
    assert "failed</span>" in listing
    # Each column is headed by its name, and the times sort.
    assert ">Last seen</a>" in listing and "Last seen shown" not in listing
    assert ">Last egress probe</a>" in listing
    page = client.get(reverse("admin:runners_runner_change", args=[runner.pk])).content.decode()
    assert "LEAK  host" in page and "connected" in page
    probe = runner.probes.get()
    detail = client.get(reverse("admin:runners_probe_change", args=[probe.pk]))
    assert detail.status_code == 200 and b"blocked (no answer in 2 s)" in detail.content
    assert client.get(reverse("admin:runners_probe_changelist")).status_code == 200

    with django_capture_on_commit_callbacks(execute=True):
        client.post(
            reverse("admin:runners_runner_changelist"),
            {"action": "probe_runners", "_selected_action": [runner.pk]},
        )
    assert [kind for kind, *_ in orders] == ["probe"]


def test_the_command_waits_for_the_report_and_says_when_none_came(
    acme, orders, django_capture_on_commit_callbacks
):
    runner, _ = online_runner(acme)
    out = io.StringIO()
    with pytest.raises(CommandError) as late, django_capture_on_commit_callbacks(execute=True):
        call_command("egress_probe", "--runner", "edge-1", "--timeout", "0.3", stdout=out)
    assert late.value.returncode == 2
    assert "no report within 0.3 s: is its runner host running?" in out.getvalue()
    assert orders == [("probe", runner.pk, str(runner.probes.get().pk))]


def test_the_command_refuses_what_it_cannot_probe(acme, orders):
    with pytest.raises(CommandError, match="no runner 'nowhere'"):
        call_command("egress_probe", "--runner", "nowhere")
    with pytest.raises(CommandError, match="no agent 'ghost'"):
        call_command("egress_probe", "--agent", "ghost")
    Runner.objects.update(last_seen_at=None)
    with pytest.raises(CommandError, match="no runner is online"):
        call_command("egress_probe")


def test_probe_settings_are_checked(settings):
    settings.COVEY_EGRESS_PROBE_INTERNET = ["1.1.1.1"]
    settings.COVEY_EGRESS_PROBE_OFF_LIST = "not a host"
    ids = sorted(e.id for e in check_probe_settings())
    assert ids == ["egress.E005", "egress.E006"]


def test_a_probe_nobody_reports_on_ends_as_an_error_and_changes_no_trust(runner, acme):
    from datetime import timedelta

    from django.utils import timezone

    AgentFactory(organisation=acme)
    found, client = runner
    passed = begin(client).json()
    report(client, passed["probe"], [OK])
    lost = begin(client).json()  # the runner host died before it reported
    fresh = begin(client).json()
    Probe.objects.filter(pk=lost["probe"]).update(created_at=timezone.now() - timedelta(minutes=6))

    assert probes.expire() == 1

    ended = Probe.objects.get(pk=lost["probe"])
    assert (ended.status, ended.detail) == ("error", "no report from the runner within 5 minutes")
    assert ended.egress_token.revoked_at is not None
    assert Probe.objects.get(pk=fresh["probe"]).status == "pending"
    found.refresh_from_db()
    assert str(found.last_probe_id) == passed["probe"] and found.trusted
    assert report(client, lost["probe"], [OK]).status_code == 404  # too late
