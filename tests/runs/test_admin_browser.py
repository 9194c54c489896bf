"""A run's page in a real browser (Debian's Chromium driven by Playwright): while the run goes
its status, times, egress counts and output arrive together from one answer, its times are
given to the second, and a refused run's message leads to the page that mends it."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from covey.display import seconds
from runners.models import Runner
from runners.protocol import ReportState, RunReport
from runs import output
from runs import services as runs
from runs.models import Run, RunStatus
from tests.agents.test_admin_browser import browser, page, window  # noqa: F401 (fixtures)
from tests.factories import AgentFactory, decision_event, record_events

pytestmark = pytest.mark.django_db(transaction=True)

TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")
REFUSED = (
    "Acme has no Anthropic API key, which the Claude runtime needs: enter one in the admin"
    " (Budgets, Model keys, Add: /admin/budgets/modelkey/add/), then start the run again"
)


@pytest.fixture
def builtin(acme):
    runner = Runner.objects.get(organisation=acme, builtin=True)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now())
    return runner


def field(page, name: str) -> str:  # noqa: F811 (a page, not the fixture)
    return page.inner_text(f".field-{name} .readonly")


def test_a_runs_status_times_egress_and_output_follow_it_together(
    window,  # noqa: F811 (the fixture imported above)
    acme,
    builtin,
    orders,
):
    agent = AgentFactory(organisation=acme, name="Builder")
    run = runs.queue_run(agent, "build it")
    runs.start(str(run.pk), builtin)
    window.goto(f"/admin/runs/run/{run.pk}/change/")
    assert window.title() == f"Run {run.short_id} of acme/builder | covey"
    assert window.inner_text("#content h1") == f"Run {run.short_id} of acme/builder"
    assert window.locator("a.deletelink").count() == 0  # a run is a record
    assert field(window, "status") == "Starting"
    assert field(window, "started_shown") == "-"
    assert "has not started" in field(window, "egress_shown")
    window.evaluate("window.notReloaded = true")

    started = timezone.now() - timedelta(seconds=30)
    runs.report(str(run.pk), builtin, RunReport(state=ReportState.RUNNING, started_at=started))
    output.append_output(str(run.pk), builtin, 0, "compiling…\n")
    record_events([decision_event(agent, host="evil.example.test", allowed=False)])
    window.wait_for_function(
        "document.getElementById('run-output').textContent.includes('compiling')"
    )
    # The same answer brought the rest: nothing lags behind the output.
    assert field(window, "status") == "Running"
    assert field(window, "started_shown") == seconds(started)
    assert TIME.match(field(window, "started_shown"))
    assert field(window, "egress_shown") == "0 allowed, 1 denied"
    assert window.evaluate("window.notReloaded") is True
    assert window.locator("#cancel-run").count() == 1

    runs.report(str(run.pk), builtin, RunReport(state=ReportState.EXITED, exit_code=0))
    # Ended, with all its output come: the page reloads whole, for its final state (asked
    # meanwhile, the new page may not hold the element yet).
    window.wait_for_function("document.getElementById('run-output')?.dataset.live === 'false'")
    finished = Run.objects.get(pk=run.pk)
    assert field(window, "status") == "Succeeded"
    assert field(window, "finished_shown") == seconds(finished.finished_at)
    assert "compiling…" in window.inner_text("#run-output")
    assert window.locator("#cancel-run").count() == 0


def test_a_refused_runs_message_is_whole_and_leads_to_the_page_that_mends_it(
    window,  # noqa: F811
    acme,
    orders,
):
    run = runs.queue_run(AgentFactory(organisation=acme, name="Claude"), "hello")
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.FAILED, status_detail=REFUSED, finished_at=timezone.now()
    )
    window.goto(f"/admin/runs/run/{run.pk}/change/")
    assert field(window, "detail_shown") == REFUSED
    with window.expect_navigation():
        window.click(".field-detail_shown a")
    assert window.url.endswith("/admin/budgets/modelkey/add/")

    window.goto("/admin/")
    failed = window.locator("#dashboard-failed")
    assert REFUSED in failed.inner_text()  # not cut before its path
    assert failed.locator("a[href='/admin/budgets/modelkey/add/']").count() == 1


def test_the_run_page_follows_one_answer_with_all_it_shows(operator_client, acme, builtin, orders):
    agent = AgentFactory(organisation=acme, name="Builder")
    run = runs.queue_run(agent, "build it")
    runs.start(str(run.pk), builtin)
    runs.report(str(run.pk), builtin, RunReport(state=ReportState.RUNNING))
    output.append_output(str(run.pk), builtin, 0, "one\n")
    first = operator_client.get(f"/admin/runs/run/{run.pk}/live/").json()
    assert (first["text"], first["size"], first["complete"], first["finished"]) == (
        "one\n",
        4,
        False,
        False,
    )
    assert first["fields"]["status"] == "Running"
    assert TIME.match(first["fields"]["started_shown"])
    assert first["fields"]["finished_shown"] == "-"
    assert "0 allowed, 0 denied" in first["fields"]["egress_shown"]

    output.append_output(str(run.pk), builtin, 4, "two\n")
    runs.report(str(run.pk), builtin, RunReport(state=ReportState.EXITED, exit_code=1))
    rest = operator_client.get(f"/admin/runs/run/{run.pk}/live/", {"offset": 4}).json()
    assert (rest["text"], rest["size"], rest["complete"], rest["finished"]) == (
        "two\n",
        8,
        True,
        True,
    )
    assert rest["fields"]["status"] == "Failed"
    answer = operator_client.get(f"/admin/runs/run/{run.pk}/live/", {"offset": "-1"})
    assert answer.status_code == 400
