"""Runs through the API and the run services, without runner processes: queueing, placement
and its reasons, cancelling, what runners may report, and the runner-facing endpoints."""

import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgets.keys import set_model_key
from runners import dispatch
from runners.host import sealing
from runners.models import Runner
from runners.protocol import ReportState, RunReport
from runners.services import (
    builtin_dir,
    renew_runner_tokens,
)
from runs import output
from runs import services as runs
from runs.models import Run, RunStatus
from tests.factories import AgentFactory, WorkplaceFactory, online_runner, runner_api

pytestmark = pytest.mark.django_db


class TestQueueing:
    def test_admins_queue_runs_and_they_are_placed(self, api, alice, acme, orders):
        runner, _ = online_runner(acme)
        agent = AgentFactory(organisation=acme)
        response = api(alice).post("/api/v1/runs/", {"agent": agent.pk, "task": "fix it"}, "json")
        assert response.status_code == 201, response.json()
        body = response.json()
        assert (body["status"], body["runner"], body["agent_version"]) == ("placed", "edge-1", 1)
        assert [e["status"] for e in body["events"]] == ["queued", "placed"]
        agent.refresh_from_db()
        assert agent.home_runner == runner

    @pytest.mark.parametrize(
        ("task", "message"), [("", "blank"), ("   ", "blank"), ("x" * 200_000, "at most")]
    )
    def test_a_task_must_be_text_of_sensible_size(self, api, alice, acme, task, message):
        agent = AgentFactory(organisation=acme)
        response = api(alice).post("/api/v1/runs/", {"agent": agent.pk, "task": task}, "json")
        assert response.status_code == 400
        assert message in json.dumps(response.json())
        assert not Run.objects.exists()

    def test_a_disabled_agent_cannot_run(self, api, alice, acme):
        agent = AgentFactory(organisation=acme, enabled=False)
        response = api(alice).post("/api/v1/runs/", {"agent": agent.pk, "task": "x"}, "json")
        assert response.status_code == 400
        assert "disabled" in json.dumps(response.json())

    def test_viewers_cannot_start_runs_and_strangers_cannot_see_them(
        self, api, vera, gary, alice, acme, orders
    ):
        agent = AgentFactory(organisation=acme)
        response = api(vera).post("/api/v1/runs/", {"agent": agent.pk, "task": "x"}, "json")
        assert response.status_code == 403  # she sees the agent; her role may not run it
        assert "does not allow" in json.dumps(response.json())
        assert not Run.objects.exists()
        run = runs.queue_run(agent, "mine")
        assert api(gary).get(f"/api/v1/runs/{run.pk}/").status_code == 404
        assert api(gary).post(f"/api/v1/runs/{run.pk}/cancel/").status_code == 404
        other = api(gary).post("/api/v1/runs/", {"agent": agent.pk, "task": "x"}, "json")
        assert other.status_code == 400  # acme's agent does not exist for gary
        assert api(vera).get(f"/api/v1/runs/{run.pk}/").status_code == 200
        assert api(vera).post(f"/api/v1/runs/{run.pk}/cancel/").status_code == 403

    def test_what_waits_and_what_happened_is_listed_per_agent(self, api, alice, acme, orders):
        first, second = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
        runs.queue_run(first, "a")
        runs.queue_run(second, "b")
        listed = api(alice).get(f"/api/v1/runs/?agent={first.pk}&status=queued").json()
        assert [r["task"] for r in listed["results"]] == ["a"]


class TestPlacement:
    def test_without_runners_the_run_says_why_it_waits(self, acme, orders):
        Runner.objects.filter(organisation=acme).delete()
        run = runs.queue_run(AgentFactory(organisation=acme), "x")
        assert (run.status, run.status_detail) == ("queued", "Acme has no runner; register one")
        assert orders == []

    def test_missing_labels_are_named(self, acme, orders):
        online_runner(acme, "plain")
        agent = AgentFactory(organisation=acme, required_labels=["gpu", "eu"])
        run = runs.queue_run(agent, "x")
        assert run.status == "queued"
        assert run.status_detail == "no runner of Acme carries eu, gpu"

    def test_a_long_reason_is_cut_to_fit_the_runs_status(self, acme, orders):
        for n in range(12):
            online_runner(acme, f"runner-with-a-rather-long-name-{n:02}-" + "x" * 40, paused=True)
        run = runs.queue_run(AgentFactory(organisation=acme), "x")
        run.refresh_from_db()
        assert run.status == "queued"
        assert len(run.status_detail) == 500 and run.status_detail.endswith("…")
        assert run.status_detail.startswith("no runner can take it now: runner-with-a-rather-")

    def test_only_online_unpaused_runners_with_every_label_take_work(
        self, acme, orders, django_capture_on_commit_callbacks
    ):
        online_runner(acme, "paused", ["gpu"], paused=True)
        stale, _ = online_runner(acme, "stale", ["gpu"])
        Runner.objects.filter(pk=stale.pk).update(last_seen_at=None)
        fit, _ = online_runner(acme, "fit", ["gpu", "eu"])
        agent = AgentFactory(organisation=acme, required_labels=["gpu"])
        with django_capture_on_commit_callbacks(execute=True):
            run = runs.queue_run(agent, "x")
        assert run.runner == fit
        assert orders == [("launch", fit.pk, str(run.pk))]

    def test_an_agent_stays_with_its_home_until_moved(self, api, alice, acme, orders):
        home, _ = online_runner(acme, "home")
        other, _ = online_runner(acme, "other")
        agent = AgentFactory(organisation=acme, home_runner=home)
        neighbour = AgentFactory(organisation=acme, home_runner=home)
        runs.queue_run(neighbour, "busy")  # home is now the busier one, yet:
        again = runs.queue_run(agent, "again")
        assert again.runner == home
        runs.report(str(again.pk), home, RunReport(ReportState.EXITED, exit_code=0))
        Runner.objects.filter(pk=home.pk).update(paused=True)
        waiting = runs.queue_run(agent, "waits")
        assert waiting.status_detail == "waiting for home, which holds the home: paused"
        response = api(alice).patch(
            f"/api/v1/agents/{agent.pk}/", {"home_runner": None}, format="json"
        )
        assert response.status_code == 200, response.json()
        assert runs.place_waiting(acme.pk) == 1
        waiting.refresh_from_db()
        assert waiting.runner == other

    def test_one_run_of_an_agent_at_a_time_uses_its_home_in_the_order_queued(
        self, acme, orders, django_capture_on_commit_callbacks
    ):
        runner, _ = online_runner(acme)
        agent = AgentFactory(organisation=acme)
        first, second, third = (runs.queue_run(agent, task) for task in ("1", "2", "3"))
        assert first.status == "placed"
        busy = f"waiting for run {first.pk} of this agent to end: one run at a time uses its home"
        assert [(r.status, r.status_detail) for r in (second, third)] == [("queued", busy)] * 2
        assert runs.place_waiting(acme.pk) == 0  # the heartbeats change nothing meanwhile
        assert runs.queue_run(AgentFactory(organisation=acme), "x").status == "placed"  # others
        with django_capture_on_commit_callbacks(execute=True):
            runs.report(str(first.pk), runner, RunReport(ReportState.EXITED, exit_code=3))
        second.refresh_from_db()
        third.refresh_from_db()
        assert (second.status, third.status) == ("placed", "queued")
        assert third.status_detail == busy.replace(str(first.pk), str(second.pk))
        assert [o for o in orders if o[2] == str(second.pk)] == [
            ("launch", runner.pk, str(second.pk))
        ]

    def test_a_run_waits_behind_an_older_one_of_its_agent_and_goes_when_that_is_cancelled(
        self, acme, alice, orders, django_capture_on_commit_callbacks
    ):
        runner, _ = online_runner(acme, paused=True)
        agent = AgentFactory(organisation=acme)
        first, second = runs.queue_run(agent, "1"), runs.queue_run(agent, "2")
        assert first.status_detail.startswith("no runner can take it now: edge-1 paused")
        behind = f"waiting behind run {first.pk} of this agent, queued before it"
        assert second.status_detail == behind
        Runner.objects.filter(pk=runner.pk).update(paused=False)
        with django_capture_on_commit_callbacks(execute=True):
            runs.cancel(first, by=alice)
        second.refresh_from_db()
        assert (second.status, second.runner) == ("placed", runner)

    def test_resuming_a_runner_places_what_waits(self, api, alice, acme, orders):
        runner, _ = online_runner(acme, paused=True)
        run = runs.queue_run(AgentFactory(organisation=acme), "x")
        assert run.status == "queued"
        response = api(alice).post(f"/api/v1/runners/{runner.pk}/resume/")
        assert response.status_code == 200 and response.json()["paused"] is False
        run.refresh_from_db()
        assert run.status == "placed"

    def test_viewers_cannot_pause_runners(self, api, vera, acme):
        runner, _ = online_runner(acme)
        assert api(vera).post(f"/api/v1/runners/{runner.pk}/pause/").status_code == 403


class TestCancelling:
    def test_a_waiting_run_is_cancelled_at_once(self, api, alice, acme, orders):
        Runner.objects.filter(organisation=acme).delete()
        run = runs.queue_run(AgentFactory(organisation=acme), "x")
        body = api(alice).post(f"/api/v1/runs/{run.pk}/cancel/").json()
        assert body["status"] == "cancelled"
        again = api(alice).post(f"/api/v1/runs/{run.pk}/cancel/")
        assert again.status_code == 409

    def test_a_started_run_is_cancelled_through_its_runner_a_placed_one_at_once(
        self, acme, orders, django_capture_on_commit_callbacks
    ):
        runner, token = online_runner(acme)
        agent = AgentFactory(organisation=acme)
        with django_capture_on_commit_callbacks(execute=True):
            placed = runs.cancel(runs.queue_run(agent, "x"))
        # Its order may be lost or on its way: its runner will not start it now, and the
        # agent's next run need not wait for it.
        assert (placed.status, placed.status_detail) == ("cancelled", "cancelled before it started")
        assert (
            runner_api(APIClient(), token)
            .post(f"/api/v1/runner/runs/{placed.pk}/start/")
            .status_code
            == 409
        )
        started = runs.queue_run(agent, "y")
        assert started.status == "placed"
        runner_api(APIClient(), token).post(f"/api/v1/runner/runs/{started.pk}/start/")
        with django_capture_on_commit_callbacks(execute=True):
            started = runs.cancel(started)
        assert started.status == "starting" and started.cancel_requested_at is not None
        assert orders[-1] == ("cancel", runner.pk, str(started.pk))


class TestRunnerEndpoints:
    def test_a_runner_starts_reports_and_ends_a_run(self, acme, orders, settings):
        settings.COVEY_EGRESS_ENFORCE = True
        _, token = online_runner(acme)
        agent = AgentFactory(organisation=acme, runtime_command=["make", "test"], memory_mb=512)
        run = runs.queue_run(agent, "build")
        client = runner_api(APIClient(), token)
        spec = client.post(f"/api/v1/runner/runs/{run.pk}/start/").json()
        assert spec["command"] == ["make", "test"] and spec["memory_mb"] == 512
        assert spec["egress"]["enforce"] is True
        username, _, secret = spec["egress"]["credentials"].partition(":")
        assert username and secret
        assert client.post(
            f"/api/v1/runner/runs/{run.pk}/report/", {"state": "running"}, format="json"
        ).json() == {"run": str(run.pk), "status": "running"}
        log = client.put(
            f"/api/v1/runner/runs/{run.pk}/log/", b"all of it\n", content_type="text/plain"
        )
        assert log.status_code == 204
        done = client.post(
            f"/api/v1/runner/runs/{run.pk}/report/",
            {"state": "exited", "exit_code": 0, "log_tail": "it\n"},
            format="json",
        )
        assert done.json()["status"] == "succeeded"
        run.refresh_from_db()
        assert run.egress_token.revoked_at is not None
        assert run.log.read() == b"all of it\n"

    def test_the_images_and_services_a_run_ran_are_kept_on_it(self, api, alice, acme, orders):
        _, token = online_runner(acme)
        workplace = WorkplaceFactory(
            organisation=acme,
            services=[{"name": "db", "image": "postgres:16"}, {"name": "web", "image": "nginx"}],
        )
        agent = AgentFactory(organisation=acme, workplace=workplace)
        run = runs.queue_run(agent, "x")
        client = runner_api(APIClient(), token)
        started = client.post(
            f"/api/v1/runner/runs/{run.pk}/start/", {"features": ["workplaces"]}, format="json"
        )
        assert [s["name"] for s in started.json()["services"]] == ["db", "web"]
        running = {
            "state": "running",
            "image_id": "sha256:aaa",
            "services": [
                {"name": "db", "image_id": "sha256:db", "ready_seconds": 1.5},
                {"name": "web", "image_id": "sha256:web", "ready_seconds": 0.1},
            ],
        }
        client.post(f"/api/v1/runner/runs/{run.pk}/report/", running, format="json")
        ended = {
            "state": "exited",
            "exit_code": 0,
            "image_id": "sha256:aaa",
            "services": [{"name": "db", "log": "ready to accept connections\n"}],
        }
        client.post(f"/api/v1/runner/runs/{run.pk}/report/", ended, format="json")
        body = api(alice).get(f"/api/v1/runs/{run.pk}/").json()
        assert body["image_id"] == "sha256:aaa"
        assert body["workplace"] == {"id": workplace.pk, "name": workplace.name, "version": 1}
        assert body["services"] == [
            {
                "name": "db",
                "image_id": "sha256:db",
                "ready_seconds": 1.5,
                "log": "ready to accept connections\n",
            },
            {"name": "web", "image_id": "sha256:web", "ready_seconds": 0.1},
        ]

    def test_a_runner_older_than_workplaces_fails_their_runs_saying_so(self, acme, orders):
        runner, token = online_runner(acme)
        workplace = WorkplaceFactory(organisation=acme, packages={"apt": ["jq"]})
        run = runs.queue_run(AgentFactory(organisation=acme, workplace=workplace), "x")
        client = runner_api(APIClient(), token)
        # It sends no features: it would ignore the packages and run the bare image.
        assert client.post(f"/api/v1/runner/runs/{run.pk}/start/").status_code == 409
        run.refresh_from_db()
        assert run.status == RunStatus.FAILED
        assert run.status_detail.startswith(
            f"runner {runner.name} cannot start a workplace's services or install its packages"
        )

    def test_a_runner_cannot_touch_another_runners_run(self, acme, orders):
        mine, _ = online_runner(acme, "mine")
        run = runs.queue_run(AgentFactory(organisation=acme), "x")
        assert run.runner == mine
        _, other_token = online_runner(acme, "other")
        client = runner_api(APIClient(), other_token)
        assert client.post(f"/api/v1/runner/runs/{run.pk}/start/").status_code == 409
        report = client.post(
            f"/api/v1/runner/runs/{run.pk}/report/", {"state": "running"}, format="json"
        )
        assert report.status_code == 404
        assert client.post("/api/v1/runner/runs/not-a-uuid/start/").status_code == 404

    def test_a_cancelled_run_is_not_started(self, acme, orders):
        _, token = online_runner(acme)
        run = runs.cancel(runs.queue_run(AgentFactory(organisation=acme), "x"))
        client = runner_api(APIClient(), token)
        assert client.post(f"/api/v1/runner/runs/{run.pk}/start/").status_code == 409
        run.refresh_from_db()
        assert run.status == RunStatus.CANCELLED


class TestTokens:
    def test_a_renewed_token_is_sealed_for_the_old_one_only(self):
        sealed = sealing.seal("a" * 64, "covey-run-new")
        assert sealing.unseal("a" * 64, sealed) == "covey-run-new"
        with pytest.raises(ValueError, match="not sealed for this runner"):
            sealing.unseal("b" * 64, sealed)

    def test_renewal_replaces_every_token_and_writes_builtin_identities(
        self, acme, monkeypatch, django_capture_on_commit_callbacks
    ):
        sent = []
        monkeypatch.setattr(dispatch, "send_token", lambda r, old, new: sent.append((r, old)))
        remote, old_token = online_runner(acme)
        builtin = Runner.objects.get(organisation=acme, builtin=True)
        with django_capture_on_commit_callbacks(execute=True):
            assert renew_runner_tokens() == Runner.objects.count()
        client = runner_api(APIClient(), old_token)
        assert client.get("/api/v1/runner/").status_code == 401
        assert [r.pk for r, _ in sent] == [remote.pk]
        identity = json.loads((builtin_dir() / f"{builtin.pk}.json").read_text())
        assert identity["id"] == builtin.pk
        fresh = runner_api(APIClient(), identity["token"]).get("/api/v1/runner/").json()
        assert (fresh["name"], fresh["builtin"], fresh["queue"]) == (
            "builtin-acme",
            True,
            "runners.builtin",
        )
        assert oct((builtin_dir() / f"{builtin.pk}.json").stat().st_mode & 0o777) == "0o600"


def test_a_sandbox_that_ended_before_it_was_reported_running_still_ran(acme, orders):
    _, token = online_runner(acme)
    run = runs.queue_run(AgentFactory(organisation=acme), "quick")
    client = runner_api(APIClient(), token)
    client.post(f"/api/v1/runner/runs/{run.pk}/start/")
    report = client.post(
        f"/api/v1/runner/runs/{run.pk}/report/",
        {
            "state": "exited",
            "exit_code": 0,
            "started_at": "2026-01-01T10:00:00Z",
            "finished_at": "2026-01-01T10:00:01Z",
        },
        format="json",
    )
    assert report.json()["status"] == "succeeded"
    run.refresh_from_db()
    assert list(run.events.values_list("status", flat=True)) == [
        "queued",
        "placed",
        "starting",
        "running",
        "succeeded",
    ]
    assert (run.finished_at - run.started_at).total_seconds() == 1


def test_whole_logs_are_pruned_after_the_retention_period(acme, orders, settings):
    settings.COVEY_RUN_LOG_RETENTION_DAYS = 30
    _, token = online_runner(acme)
    client = runner_api(APIClient(), token)
    old, recent = (runs.queue_run(AgentFactory(organisation=acme), t) for t in ("old", "new"))
    for run in (old, recent):
        client.post(f"/api/v1/runner/runs/{run.pk}/start/")
        client.put(f"/api/v1/runner/runs/{run.pk}/log/", b"output\n", content_type="text/plain")
        client.post(
            f"/api/v1/runner/runs/{run.pk}/report/",
            {"state": "exited", "exit_code": 0, "log_tail": "output\n"},
            format="json",
        )
    Run.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(days=31))
    old.refresh_from_db()
    path = Path(old.log.path)
    assert path.exists()
    assert runs.prune_logs() == 1
    old.refresh_from_db()
    recent.refresh_from_db()
    assert not old.log and not path.exists() and old.log_tail == "output\n"
    assert recent.log.read() == b"output\n"


class TestLiveOutput:
    """A running run's output arrives in chunks and can be followed by offset (issue 9, item 4)."""

    def started(self, acme, api, alice):
        _, token = online_runner(acme)
        run = runs.queue_run(AgentFactory(organisation=acme), "long")
        runner = runner_api(APIClient(), token)
        runner.post(f"/api/v1/runner/runs/{run.pk}/start/")
        runner.post(f"/api/v1/runner/runs/{run.pk}/report/", {"state": "running"}, format="json")
        return run, runner, api(alice)

    def send(self, runner, run, offset, text):
        return runner.post(
            f"/api/v1/runner/runs/{run.pk}/output/", {"offset": offset, "text": text}, "json"
        )

    def test_output_is_readable_while_the_run_goes_and_followed_by_offset(
        self, acme, api, alice, orders
    ):
        run, runner, user = self.started(acme, api, alice)
        empty = user.get(f"/api/v1/runs/{run.pk}/log/")
        assert (empty.content, empty["X-Covey-Log-Size"]) == (b"", "0")
        assert empty["X-Covey-Log-Complete"] == "false"
        assert self.send(runner, run, 0, "step one ✓\n").json()["size"] == 13
        assert self.send(runner, run, 13, "step two\n").json()["size"] == 22
        whole = user.get(f"/api/v1/runs/{run.pk}/log/")
        assert whole.content.decode() == "step one ✓\nstep two\n"
        assert whole["X-Covey-Log-Size"] == "22"
        later = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": 13})
        assert later.content == b"step two\n"
        assert user.get(f"/api/v1/runs/{run.pk}/").json()["log_tail"].endswith("step two\n")
        # The end: the whole log replaces the pieces, and the answer says no more will come.
        runner.put(
            f"/api/v1/runner/runs/{run.pk}/log/",
            "step one ✓\nstep two\nstep three\n".encode(),
            content_type="text/plain",
        )
        runner.post(
            f"/api/v1/runner/runs/{run.pk}/report/", {"state": "exited", "exit_code": 0}, "json"
        )
        last = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": 22})
        assert (last.getvalue(), last["X-Covey-Log-Complete"]) == (b"step three\n", "true")
        assert last["X-Covey-Log-Size"] == "33"
        assert not run.output.exists()

    def test_output_at_the_wrong_offset_is_refused_with_where_to_go_on(
        self, acme, api, alice, orders
    ):
        run, runner, user = self.started(acme, api, alice)
        self.send(runner, run, 0, "abc")
        resent = self.send(runner, run, 0, "abc")
        assert (resent.status_code, resent.json()["size"]) == (409, 3)
        ahead = self.send(runner, run, 10, "xyz")
        assert (ahead.status_code, ahead.json()["size"]) == (409, 3)
        assert user.get(f"/api/v1/runs/{run.pk}/log/").content == b"abc"

    @pytest.mark.parametrize("offset", ["-1", "x", "²", "1e3", str(2**70)])
    def test_a_bad_offset_is_a_clear_error(self, acme, api, alice, orders, offset):
        run, runner, user = self.started(acme, api, alice)
        answer = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": offset})
        assert answer.status_code == 400
        assert answer.json()["offset"][0].startswith(("give a number of bytes", "Ensure"))
        assert self.send(runner, run, -1, "x").status_code == 400

    def test_an_offset_past_the_end_gives_nothing_and_says_where_it_ends(
        self, acme, api, alice, orders
    ):
        run, runner, user = self.started(acme, api, alice)
        self.send(runner, run, 0, "abc")
        answer = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": 10**9})
        assert (answer.content, answer["X-Covey-Log-Size"]) == (b"", "3")

    def test_a_run_that_ended_takes_no_more_live_output(self, acme, api, alice, orders):
        run, runner, user = self.started(acme, api, alice)
        self.send(runner, run, 0, "abc")
        runner.post(
            f"/api/v1/runner/runs/{run.pk}/report/", {"state": "exited", "exit_code": 0}, "json"
        )
        late = self.send(runner, run, 3, "late")
        assert (late.status_code, late.json()["size"]) == (410, 3)
        answer = user.get(f"/api/v1/runs/{run.pk}/log/")
        # Its runner never sent a whole log: what arrived is all there is.
        assert (answer.content, answer["X-Covey-Log-Complete"]) == (b"abc", "true")

    def test_live_output_stops_at_its_cap_and_the_whole_log_brings_the_rest(
        self, acme, api, alice, orders, monkeypatch
    ):
        monkeypatch.setattr(output, "MAX_LIVE_OUTPUT_BYTES", 10)
        run, runner, user = self.started(acme, api, alice)
        assert self.send(runner, run, 0, "0123456789").status_code == 200
        assert self.send(runner, run, 10, "x").status_code == 410
        runner.put(
            f"/api/v1/runner/runs/{run.pk}/log/", b"0123456789xyz", content_type="text/plain"
        )
        answer = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": 10})
        assert (answer.getvalue(), answer["X-Covey-Log-Size"]) == (b"xyz", "13")

    def test_a_whole_log_that_lost_its_start_keeps_offsets_where_they_were(
        self, acme, api, alice, orders
    ):
        """Docker keeps only the last of a large output: the runner says how much the sandbox
        wrote in all, and offsets still mean the same bytes."""
        run, runner, user = self.started(acme, api, alice)
        self.send(runner, run, 0, "aaaa")
        runner.put(
            f"/api/v1/runner/runs/{run.pk}/log/",
            b"ccdd",
            content_type="text/plain",
            headers={"X-Covey-Output-Total": "8"},
        )
        run.refresh_from_db()
        assert (run.log_start, run.output_size) == (4, 8)
        whole = user.get(f"/api/v1/runs/{run.pk}/log/")
        assert (whole.getvalue(), whole["X-Covey-Log-Start"]) == (b"ccdd", "4")
        assert whole["X-Covey-Log-Size"] == "8"
        tail = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": 6})
        assert tail.getvalue() == b"dd"
        bad = runner.put(
            f"/api/v1/runner/runs/{run.pk}/log/",
            b"x",
            content_type="text/plain",
            headers={"X-Covey-Output-Total": "-1"},
        )
        assert bad.status_code == 400

    def test_a_nul_in_the_output_is_kept_as_a_replacement_character(self, acme, api, alice, orders):
        """PostgreSQL text cannot hold NUL: the whole log keeps U+FFFD, as the runner's live
        output does (tests/runners/test_output.py), so both count the same bytes."""
        run, runner, user = self.started(acme, api, alice)
        runner.put(f"/api/v1/runner/runs/{run.pk}/log/", b"a\x00b", content_type="text/plain")
        run.refresh_from_db()
        assert (run.output_size, run.log_tail) == (5, "a\ufffdb")
        answer = user.get(f"/api/v1/runs/{run.pk}/log/")
        assert answer.getvalue().decode() == "a\ufffdb"

    def test_a_long_live_output_comes_in_answers_that_never_cut_a_character(
        self, acme, api, alice, orders, monkeypatch
    ):
        monkeypatch.setattr(output, "MAX_LIVE_ANSWER_BYTES", 5)
        run, runner, user = self.started(acme, api, alice)
        self.send(runner, run, 0, "ab")
        self.send(runner, run, 2, "cé€")  # 1 + 2 + 3 bytes
        got, offset = [], 0
        while True:
            answer = user.get(f"/api/v1/runs/{run.pk}/log/", {"offset": offset})
            if not answer.content:
                break
            got.append(answer.content.decode())
            offset = int(answer["X-Covey-Log-Size"])
        assert got == ["abcé", "€"]

    def test_another_runner_cannot_send_a_runs_output(self, acme, api, alice, orders):
        run, _, user = self.started(acme, api, alice)
        _, other = online_runner(acme, "other")
        answer = self.send(runner_api(APIClient(), other), run, 0, "forged")
        assert answer.status_code == 404
        assert user.get(f"/api/v1/runs/{run.pk}/log/").content == b""


def test_a_claude_runtime_run_without_the_organisations_key_fails_before_a_sandbox(
    acme, orders, settings
):
    """Through the model gateway the Claude runtime needs its organisation's Anthropic key:
    without one the run fails when its runner asks to start it, saying where to enter the key,
    and no sandbox is built; with one it starts, with the gateway's URL and a run token."""
    settings.COVEY_MODEL_GATEWAY_URL = "http://172.17.0.1:8002"
    _, token = online_runner(acme)
    client = runner_api(APIClient(), token)
    agent = AgentFactory(organisation=acme, runtime_command=[])
    run = runs.queue_run(agent, "fix it")
    answer = client.post(f"/api/v1/runner/runs/{run.pk}/start/")
    assert answer.status_code == 409
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.finished_at is not None
    assert run.status_detail == (
        "Acme has no Anthropic API key, which the Claude runtime needs: enter one in the admin"
        " (Budgets, Model keys, Add: /admin/budgets/modelkey/add/), then start the run again"
    )
    assert run.egress_token is None  # no credential was made for it
    # An agent with a command of its own needs no key.
    own = runs.queue_run(AgentFactory(organisation=acme, runtime_command=["make"]), "x")
    assert client.post(f"/api/v1/runner/runs/{own.pk}/start/").status_code == 200
    set_model_key(acme, "sk-ant-api03-a-key-of-acmes-0123456789")
    again = runs.queue_run(agent, "fix it")
    spec = client.post(f"/api/v1/runner/runs/{again.pk}/start/").json()
    assert spec["model"]["base_url"] == "http://172.17.0.1:8002" and spec["model"]["token"]
    assert "--dangerously-skip-permissions" in spec["command"][-1]


def test_a_default_runtime_run_on_an_image_without_claude_says_what_to_do(acme, orders):
    """Without a command of its own an agent runs the Claude runtime; on an image that lacks it
    the status names the image and the way out (issue 9, item 5)."""
    _, token = online_runner(acme)
    agent = AgentFactory(organisation=acme, runtime_command=[])
    run = runs.queue_run(agent, "fix it")
    client = runner_api(APIClient(), token)
    spec = client.post(f"/api/v1/runner/runs/{run.pk}/start/").json()
    assert "command -v claude" in spec["command"][-1]
    done = client.post(
        f"/api/v1/runner/runs/{run.pk}/report/", {"state": "exited", "exit_code": 127}, "json"
    )
    assert done.json()["status"] == "failed"
    run.refresh_from_db()
    assert f"the image {spec['image']} has no Claude runtime" in run.status_detail
    assert "workplace" in run.status_detail and "runtime command" in run.status_detail
    # An agent with a command of its own that exits 127 is only that.
    other = runs.queue_run(AgentFactory(organisation=acme, runtime_command=["nope"]), "x")
    client.post(f"/api/v1/runner/runs/{other.pk}/start/")
    client.post(
        f"/api/v1/runner/runs/{other.pk}/report/", {"state": "exited", "exit_code": 127}, "json"
    )
    other.refresh_from_db()
    assert other.status_detail == "exit code 127"


def test_what_a_run_changed_in_its_home_is_kept_and_shown(acme, alice, root, api, orders, client):
    _, token = online_runner(acme)
    run = runs.queue_run(AgentFactory(organisation=acme), "edit")
    runner = runner_api(APIClient(), token)
    runner.post(f"/api/v1/runner/runs/{run.pk}/start/")
    changes = {
        "added": ["src/new.py"], "changed": ["notes.md"], "removed": ["old<script>.txt"],
        "added_total": 1, "changed_total": 1, "removed_total": 1,
    }  # fmt: skip
    report = runner.post(
        f"/api/v1/runner/runs/{run.pk}/report/",
        {"state": "exited", "exit_code": 0, "changes": changes},
        format="json",
    )
    assert report.status_code == 200, report.json()
    body = api(alice).get(f"/api/v1/runs/{run.pk}/").json()
    assert body["home_changes"] == changes
    malformed = runner.post(
        f"/api/v1/runner/runs/{run.pk}/report/",
        {"state": "exited", "exit_code": 0, "changes": {"added": "not a list"}},
        format="json",
    )
    assert malformed.status_code == 400
    client.force_login(root)
    page = client.get(f"/admin/runs/run/{run.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "1 added" in html and "src/new.py" in html
    assert "old&lt;script&gt;.txt" in html and "old<script>" not in html


def test_the_home_quota_goes_with_the_spec_and_what_the_home_holds_comes_back(
    acme, alice, api, orders, settings, client, root
):
    settings.COVEY_HOME_QUOTA_MB = 300
    _, token = online_runner(acme)
    runner = runner_api(APIClient(), token)
    default, limited = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
    response = api(alice).patch(f"/api/v1/agents/{limited.pk}/", {"home_quota_mb": 5}, "json")
    assert response.status_code == 200, response.json()
    assert response.json()["home_usage"] == {
        "bytes": None, "files": None, "quota_bytes": 5 * 1024 * 1024, "measured_at": None,
    }  # fmt: skip
    limited.refresh_from_db()  # at its new version
    quotas = []
    for agent in (default, limited):
        run = runs.queue_run(agent, "x")
        quotas.append(
            runner.post(f"/api/v1/runner/runs/{run.pk}/start/").json()["home_quota_bytes"]
        )
    assert quotas == [300 * 1024 * 1024, 5 * 1024 * 1024]
    report = runner.post(
        f"/api/v1/runner/runs/{run.pk}/report/",
        {"state": "built", "detail": "the home holds 6.0 MiB, more than its quota of 5.0 MiB",
         "usage": {"bytes": 6 * 1024 * 1024, "files": 12}},
        format="json",
    )  # fmt: skip
    assert report.json()["status"] == "failed"
    usage = api(alice).get(f"/api/v1/agents/{limited.pk}/").json()["home_usage"]
    assert (usage["bytes"], usage["files"], usage["quota_bytes"]) == (6 * 1024**2, 12, 5 * 1024**2)
    assert usage["measured_at"] is not None
    client.force_login(root)
    listing = client.get("/admin/agents/agent/").content.decode()
    assert "6.0 MiB of 5.0 MiB (12 files)" in listing
    assert "not measured yet (of 300.0 MiB)" in listing


@pytest.mark.parametrize("quota", [0, -1, "lots"])
def test_a_home_quota_is_a_positive_number_of_mib(acme, alice, api, quota):
    agent = AgentFactory(organisation=acme)
    response = api(alice).patch(f"/api/v1/agents/{agent.pk}/", {"home_quota_mb": quota}, "json")
    assert response.status_code == 400 and "home_quota_mb" in response.json()


def test_a_run_its_runner_stopped_for_the_home_quota_fails_saying_so(acme, orders):
    _, token = online_runner(acme)
    run = runs.queue_run(AgentFactory(organisation=acme), "fill the disk")
    client = runner_api(APIClient(), token)
    client.post(f"/api/v1/runner/runs/{run.pk}/start/")
    detail = "home-over-quota: its home passed its quota (12.0 GiB of 10.0 GiB)"
    report = client.post(
        f"/api/v1/runner/runs/{run.pk}/report/",
        {"state": "exited", "exit_code": 137, "detail": detail},
        format="json",
    )
    assert report.json()["status"] == "failed"
    run.refresh_from_db()
    assert run.status_detail == "stopped: its home passed its quota (12.0 GiB of 10.0 GiB)"


def test_a_negative_home_quota_setting_stops_start_up_and_zero_means_none(settings, acme):
    from runners.checks import check_home_settings

    settings.COVEY_HOME_QUOTA_MB = -1
    assert [e.id for e in check_home_settings()] == ["runners.E001"]
    settings.COVEY_HOME_QUOTA_MB = 0
    assert check_home_settings() == []
    agent = AgentFactory(organisation=acme)
    assert agent.home_usage_text() == "not measured yet (no quota)"
