"""Homes on the control plane, without a runner: where a home is and what is refused before
anything is ordered (offline, a run active, over quota, too large), what a runner may take and
answer, and the pruning of operations and spool files."""

import io
import os
import time
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from agents.models import Agent
from homes import services
from homes.models import HomeChange, HomeOperation, OperationState
from homes.services import HomeProblem
from runners.models import Runner
from runners.protocol import HomeOp
from runs import services as runs
from tests.factories import AgentFactory, online_runner, runner_api

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent(acme):
    return AgentFactory(organisation=acme, name="Keeper")


def test_an_agent_without_a_home_gets_one_where_its_runs_would_go_on_a_change(agent, acme):
    runner, _ = online_runner(acme)
    with pytest.raises(HomeProblem) as problem:
        services.holder(agent, make=False)  # a look places nothing
    assert problem.value.status == 404 and "no home yet" in problem.value.detail
    assert Agent.objects.get(pk=agent.pk).home_runner is None
    assert services.holder(agent, make=True) == runner
    agent.refresh_from_db()
    assert agent.home_runner == runner


def test_a_home_on_an_offline_runner_says_which_runner_and_since_when(agent, acme):
    runner, _ = online_runner(acme)
    agent.home_runner = runner
    agent.save()
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now() - timedelta(hours=2))
    agent.refresh_from_db()
    with pytest.raises(HomeProblem) as problem:
        services.holder(agent, make=True)
    assert problem.value.status == 503
    assert "on runner edge-1: it has been silent since" in problem.value.detail
    assert "(7200 s)" in problem.value.detail or "(7199 s)" in problem.value.detail
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=None)
    agent.refresh_from_db()
    with pytest.raises(HomeProblem, match="never been heard from"):
        services.holder(agent, make=True)


def test_no_runner_for_a_new_home_is_a_503_saying_why(agent):
    Runner.objects.filter(organisation=agent.organisation).delete()
    with pytest.raises(HomeProblem) as problem:
        services.holder(agent, make=True)
    assert problem.value.status == 503 and "has no runner; register one" in problem.value.detail


def test_a_change_while_a_run_is_active_is_refused_and_recorded(
    agent, acme, alice, orders, django_capture_on_commit_callbacks
):
    online_runner(acme)
    with django_capture_on_commit_callbacks(execute=True):
        run = runs.queue_run(agent, "work")
    assert run.status == "placed"
    with pytest.raises(HomeProblem) as problem, django_capture_on_commit_callbacks(execute=True):
        services.change(agent, alice, HomeOp.MKDIR, "x")
    assert problem.value.status == 409 and str(run.pk) in problem.value.detail
    assert [kind for kind, _, _ in orders] == ["launch"]  # the run's; no home order
    assert not HomeOperation.objects.exists()
    (change,) = HomeChange.objects.all()
    assert (change.by_name, change.operation, change.path, change.status) == (
        "alice", "mkdir", "x", 409,
    )  # fmt: skip


def test_uploads_past_the_quota_or_the_cap_are_refused_before_their_bytes(agent, settings):
    settings.COVEY_HOME_UPLOAD_MAX_MB = 1
    agent.home_quota_mb = 1
    agent.home_bytes, agent.home_files = 1024 * 1024 - 100, 1
    agent.save()
    with pytest.raises(HomeProblem, match=r"100 bytes more would pass it|101 bytes"):
        services.check_upload(agent, "new", 101, replace=False)
    services.check_upload(agent, "new", 100, replace=False)
    with pytest.raises(HomeProblem) as problem:
        services.check_upload(agent, "new", 2 * 1024 * 1024, replace=False)
    assert problem.value.status == 413
    assert "more than one upload may carry (1.0 MiB)" in problem.value.detail


def test_a_runner_takes_only_its_own_operations_once_and_not_once_given_up(
    agent, acme, globex, orders, django_capture_on_commit_callbacks
):
    runner, token = online_runner(acme)
    _, other_token = online_runner(globex, "edge-9")
    Agent.objects.filter(pk=agent.pk).update(home_runner=runner)
    agent.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        op = services.order(agent, HomeOp.LIST, path="")
    assert orders == [("home", runner.pk, str(op.pk))]
    client = runner_api(APIClient(), token)
    foreign = runner_api(APIClient(), other_token)
    assert foreign.post(f"/api/v1/runner/home/{op.pk}/take/").status_code == 404
    taken = client.post(f"/api/v1/runner/home/{op.pk}/take/")
    assert taken.status_code == 200 and taken.json()["kind"] == "list"
    assert client.post(f"/api/v1/runner/home/{op.pk}/take/").status_code == 410
    answered = client.post(
        f"/api/v1/runner/home/{op.pk}/answer/", {"status": 200, "total": 3}, format="json"
    )
    assert answered.status_code == 204
    op.refresh_from_db()
    assert op.state == OperationState.ANSWERED and services.answer_of(op).total == 3

    late = services.order(agent, HomeOp.STAT, path="x")
    HomeOperation.objects.filter(pk=late.pk).update(state=OperationState.ABANDONED)
    assert client.post(f"/api/v1/runner/home/{late.pk}/take/").status_code == 410
    for endpoint in ("answer", "body"):
        assert foreign.post(f"/api/v1/runner/home/{late.pk}/{endpoint}/").status_code in (404, 405)
    assert foreign.get(f"/api/v1/runner/home/{late.pk}/body/").status_code == 404
    again = services.order(agent, HomeOp.STAT, path="y")
    client.post(f"/api/v1/runner/home/{again.pk}/take/")
    bad = client.post(f"/api/v1/runner/home/{again.pk}/answer/", {"status": "x"}, format="json")
    assert bad.status_code == 400 and "status" in bad.json()[0]


def test_old_operations_and_stray_spool_files_are_pruned(agent, acme, orders, settings, tmp_path):
    settings.COVEY_HOME_SPOOL = tmp_path / "spool"
    runner, _ = online_runner(acme)
    Agent.objects.filter(pk=agent.pk).update(home_runner=runner)
    agent.refresh_from_db()
    old = services.order(agent, HomeOp.LIST)
    going = services.order(agent, HomeOp.READ)  # a long download, still streaming
    stuck = services.order(agent, HomeOp.READ)
    new = services.order(agent, HomeOp.LIST)
    HomeOperation.objects.filter(pk=old.pk).update(
        created_at=timezone.now() - timedelta(hours=2), state=OperationState.ANSWERED
    )
    HomeOperation.objects.filter(pk=going.pk).update(
        created_at=timezone.now() - timedelta(hours=2), state=OperationState.STREAMING
    )
    HomeOperation.objects.filter(pk=stuck.pk).update(created_at=timezone.now() - timedelta(days=2))
    stray = services.download_path(uuid.uuid4())
    stray.write_bytes(b"left by a killed web process")
    an_hour_ago = time.time() - 2 * 3600
    os.utime(stray, (an_hour_ago, an_hour_ago))
    kept = services.download_path(new.pk)
    kept.write_bytes(b"being read")
    os.utime(kept, (an_hour_ago, an_hour_ago))
    assert services.prune() == 2
    assert set(HomeOperation.objects.values_list("pk", flat=True)) == {going.pk, new.pk}
    assert not stray.exists() and kept.exists()


def test_a_download_name_is_said_safely():
    said = services.attachment('ré"port\n.txt')
    assert said == "attachment; filename=\"r?_port_.txt\"; filename*=UTF-8''r%C3%A9%22port%0A.txt"


def test_a_change_answered_after_its_asker_gave_up_is_settled_all_the_same(agent, acme, alice):
    runner, token = online_runner(acme)
    Agent.objects.filter(pk=agent.pk).update(home_runner=runner, home_bytes=100, home_files=2)
    agent.refresh_from_db()
    record = services._record(agent, alice, HomeOp.DELETE, "d")
    record.save()
    op = services.order(agent, HomeOp.DELETE, change=record, path="d")
    client = runner_api(APIClient(), token)
    assert client.post(f"/api/v1/runner/home/{op.pk}/take/").status_code == 200
    HomeOperation.objects.filter(pk=op.pk).update(state=OperationState.ABANDONED)  # it waited
    services._refused(record, 504, "runner edge-1 took the operation and did not finish it")
    record.refresh_from_db()
    assert (record.status, record.settled) == (504, False)
    late = {"status": 200, "bytes_delta": -60, "files_delta": -1}
    answered = client.post(f"/api/v1/runner/home/{op.pk}/answer/", late, format="json")
    assert answered.status_code == 204
    record.refresh_from_db()
    agent.refresh_from_db()
    assert (record.status, record.bytes, record.settled) == (200, 60, True)
    assert (agent.home_bytes, agent.home_files) == (40, 1)
    again = client.post(f"/api/v1/runner/home/{op.pk}/answer/", late, format="json")
    assert again.status_code == 204
    agent.refresh_from_db()
    assert agent.home_bytes == 40  # settled once


def test_a_change_refused_for_the_askers_role_is_in_the_homes_audit(agent, vera, alice):
    """The audit lists every change made from outside, or refused: a viewer's tries too, with
    what they asked for, though nothing was ordered and no bytes were read."""
    viewer = APIClient()
    viewer.force_authenticate(vera)
    base = f"/api/v1/agents/{agent.pk}/home"
    made = [
        viewer.post(f"{base}/mkdir/", {"path": "made"}, format="json"),
        viewer.post(f"{base}/move/", {"path": "a", "target": "b"}, format="json"),
        viewer.post(f"{base}/delete/", {"path": "d"}, format="json"),
        viewer.put(
            f"{base}/file/?path=notes/x.bin", b"x" * 10, content_type="application/octet-stream"
        ),
        viewer.post(f"{base}/upload/?path=docs", {"files": [io.BytesIO(b"y")]}, format="multipart"),
        viewer.put(f"{base}/file/?path=nul%00byte", b"", content_type="application/octet-stream"),
        viewer.post(f"{base}/mkdir/", b"{not json", content_type="application/json"),
        # Read and refused by the strict parser (a NaN): still the role's refusal, recorded.
        viewer.post(f"{base}/mkdir/", b'{"path": NaN}', content_type="application/json"),
    ]
    assert [answer.status_code for answer in made] == [403] * 8
    assert made[0].json()["detail"] == services.ROLE_REFUSAL
    said = HomeChange.objects.order_by("at", "pk").values_list(
        "by_name", "operation", "path", "target", "bytes", "status", "settled"
    )
    assert list(said) == [
        ("vera", "mkdir", "made", "", 0, 403, True),
        ("vera", "move", "a", "b", 0, 403, True),
        ("vera", "delete", "d", "", 0, 403, True),
        ("vera", "write", "notes/x.bin", "", 10, 403, True),
        ("vera", "write", "docs", "", 0, 403, True),
        ("vera", "write", "nul\ufffdbyte", "", 0, 403, True),
        ("vera", "mkdir", "", "", 0, 403, True),
        ("vera", "mkdir", "", "", 0, 403, True),
    ]
    assert not HomeOperation.objects.exists()
    admin = APIClient()
    admin.force_authenticate(alice)
    audit = admin.get(f"{base}/changes/").json()
    assert audit["count"] == 8 and audit["results"][0]["status"] == 403


def test_another_organisations_member_sees_no_home_and_a_viewer_changes_none(agent, gary, vera):
    foreign = APIClient()
    foreign.force_authenticate(gary)
    for path in ("", "entries/", "stat/?path=x", "download/?path=x", "usage/", "changes/"):
        assert foreign.get(f"/api/v1/agents/{agent.pk}/home/{path}").status_code == 404, path
    assert foreign.post(f"/api/v1/agents/{agent.pk}/home/mkdir/", {"path": "x"}).status_code == 404
    viewer = APIClient()
    viewer.force_authenticate(vera)
    assert viewer.get(f"/api/v1/agents/{agent.pk}/home/entries/").json()["total"] == 0
    for action in ("mkdir", "move", "delete", "upload"):
        refused = viewer.post(f"/api/v1/agents/{agent.pk}/home/{action}/", {"path": "x"})
        assert refused.status_code == 403, action
    for route in ("", "stat/?path=x", "changes/", "download/?path=x"):  # only their own methods
        assert (
            viewer.put(f"/api/v1/agents/{agent.pk}/home/{route}", {"path": "x"}).status_code == 405
        )
        assert viewer.delete(f"/api/v1/agents/{agent.pk}/home/{route}").status_code == 405
    assert not HomeOperation.objects.exists()
    refused = HomeChange.objects.values_list("by_name", "status")
    assert sorted(refused) == [("vera", 403)] * 4  # in the audit; gary's 404s are not
