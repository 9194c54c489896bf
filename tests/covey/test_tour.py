"""The admin tour of a person who decides, in a real browser (Debian's Chromium driven by
Playwright) against `make run`'s own script: sign in, read the dashboard, create an agent,
start a run from its page, watch its output arrive, see what the proxy refused, and open that
decision from the run."""

import re

import pytest

from tests.agents.test_admin_browser import browser, type_name_and_see_slug  # noqa: F401
from tests.covey.test_run import fetch, run_env
from tests.processes import ROOT, running, wait_for

COMMAND = (
    '["sh", "-c", "echo starting; sleep 6;'
    " curl -s -o /dev/null -w 'connect=%{http_connect}\\\\n' https://not-on-the-list.test/;"
    ' echo done"]'
)


@pytest.mark.docker
def test_the_tour_from_the_dashboard_to_a_runs_refused_connection(
    tmp_path,
    base_image,
    browser,  # noqa: F811 - a fixture imported above
):
    from tests.processes import free_port

    port = free_port()
    env = run_env(tmp_path, port) | {"COVEY_DEFAULT_IMAGE": base_image}
    log = tmp_path / "run.log"
    base = f"http://127.0.0.1:{port}"
    with running([str(ROOT / "scripts" / "run")], env, log):
        wait_for(lambda: b"taking orders" in log.read_bytes(), 180, "the built-in runner", log)
        wait_for(lambda: fetch(f"{base}/admin/login/")[0] == 200, 60, "the control plane", log)
        password = re.search(r"Created superuser 'admin' with password: (\S+)", log.read_text())
        assert password, log.read_text()
        context = browser.new_context(base_url=base)
        page = context.new_page()
        try:
            page.goto("/admin/login/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", password.group(1))
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/")

            # The dashboard: the demo organisation's built-in runner, online; nothing refused.
            runners = page.inner_text("#dashboard-runners")
            assert "builtin" in runners and "online" in runners, runners
            assert "Nothing was refused." in page.inner_text("#dashboard-denials")

            # An agent, created in the admin.
            page.goto("/admin/agents/agent/add/")
            page.select_option("#id_organisation", label="Demo")
            type_name_and_see_slug(page, "Tourist", "tourist")
            page.fill("#id_runtime_command", COMMAND)
            page.click("input[name=_continue]")
            page.wait_for_selector("#start-run")
            assert "was added successfully" in page.inner_text(".messagelist")

            # A run, started from its page; its output arrives while it goes.
            page.fill("#run-task", "look around")
            page.click("#start-run input[type=submit]")
            page.wait_for_url(re.compile(r".*/admin/runs/run/[0-9a-f-]+/change/$"))
            run_url = page.url
            page.wait_for_function(
                "document.getElementById('run-output').textContent.includes('starting')",
                timeout=60_000,
            )
            assert page.get_attribute("#run-output", "data-live") == "true"  # not reloaded
            # When it ends, the page reloads for its status, with the whole output (asked
            # meanwhile, the new page may not hold the element yet).
            page.wait_for_function(
                "document.getElementById('run-output')?.dataset.live === 'false'", timeout=90_000
            )
            assert "connect=403" in page.inner_text("#run-output")
            assert "done" in page.inner_text("#run-output")
            assert "Succeeded" in page.inner_text(".field-status"), page.inner_text("#content")
            assert page.locator("#cancel-run").count() == 0  # nothing left to cancel

            # The proxy's refusal reaches the control plane within its batch interval.
            def denied() -> bool:
                page.goto(run_url)
                return "1 denied" in page.inner_text("#run-decisions")

            wait_for(denied, 30, "the run's denial recorded", log)
            page.click("#run-decisions")
            page.wait_for_selector("#result_list")
            listed = page.inner_text("#result_list")
            assert "not-on-the-list.test" in listed and "not-on-allowlist" in listed, listed
            page.click("#result_list tbody tr th a")  # the decision itself
            page.wait_for_selector(".field-run")
            short = run_url.rstrip("/").split("/")[-2][:8]
            assert short in page.inner_text(".field-run")
            page.click(".field-run a")  # back to its run
            page.wait_for_url(run_url)

            # And the dashboard shows it among the recent denials, linked to it.
            page.goto("/admin/")
            assert "not-on-the-list.test:443" in page.inner_text("#dashboard-denials")
            page.goto("/admin/agents/agent/?q=tourist")
            page.click("#result_list tbody tr th a")  # its name
            assert "not-on-the-list.test:443" in page.inner_text(".field-recent_denials")
            assert short in page.inner_text(".field-recent_runs")
        finally:
            context.close()
