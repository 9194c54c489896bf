"""covey's log lines (logs/): one JSON object per line with COVEY_LOG_FORMAT=json, the ids of
the run and agent a line concerns, nothing else a record carries; and the real web server's
lines in JSON, with the run its URL names."""

import io
import json
import logging
import uuid

import httpx
import pytest

import logs
from covey.celery import _bind_ids, _unbind_ids
from runs import tasks as run_tasks
from tests.egress.conftest import subprocess_database_url
from tests.processes import control_plane


def json_logger(name: str) -> tuple[logging.Logger, io.StringIO]:
    logs.install()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.Json())
    logger = logging.getLogger(name)
    logger.handlers, logger.propagate, logger.level = [handler], False, logging.INFO
    return logger, out


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_json_line_holds_its_fields_and_the_ids_bound_where_it_was_made():
    logger, out = json_logger("covey.test.json")
    with logs.bound(run_id="r-1", agent_id=7):
        logger.info("started %s", "it", extra={"request": object(), "password": "hunter2"})
        with logs.bound(runner_id=3, agent_id=None):  # None binds nothing
            logger.warning("inner")
    logger.info("outside")
    first, inner, outside = lines(out)
    assert set(first) == {"time", "level", "logger", "message", "run_id", "agent_id"}
    assert (first["message"], first["level"], first["logger"]) == (
        "started it",
        "INFO",
        "covey.test.json",
    )
    assert (first["run_id"], first["agent_id"]) == ("r-1", 7)
    assert "hunter2" not in out.getvalue()  # what a record carries besides is never written
    assert (inner["runner_id"], inner["agent_id"]) == (3, 7)
    assert "run_id" not in outside


def test_an_exception_is_in_its_line_and_extra_ids_win_over_bound_ones():
    logger, out = json_logger("covey.test.exception")
    with logs.bound(run_id="bound"):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed", extra={"run_id": "given"})
    (line,) = lines(out)
    assert line["run_id"] == "given"
    assert "RuntimeError: boom" in line["exc_info"]


def test_an_unknown_format_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"COVEY_LOG_FORMAT='yaml': choose text or json"):
        logs.check_format("yaml")


def test_a_task_binds_its_name_and_the_ids_among_its_arguments():
    before = dict(logs.current())
    _bind_ids(task_id="t-1", task=run_tasks.stop_over_budget, args=(3,), kwargs={})
    assert logs.current() == {**before, "task": run_tasks.stop_over_budget.name, "agent_id": 3}
    _unbind_ids(task_id="t-1")
    assert dict(logs.current()) == before


@pytest.mark.e2e  # a control plane of its own
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_web_server_writes_json_lines_with_the_run_its_url_names(tmp_path):
    run_id = str(uuid.uuid4())
    secret = "covey-runner-not-a-real-token-0123456789"
    env = {"COVEY_LOG_FORMAT": "json", "GUNICORN_CMD_ARGS": "--access-logfile -"}
    with control_plane(tmp_path, subprocess_database_url(), **env) as url:
        answer = httpx.post(
            f"{url}/api/v1/runner/runs/{run_id}/start/",
            headers={"Authorization": f"Runner {secret}"},
        )
        assert answer.status_code in (401, 403)
        httpx.get(f"{url}/healthz")
    (log,) = tmp_path.glob("control-plane-*.log")
    text = log.read_text()
    written = [json.loads(line) for line in text.splitlines() if line.strip()]  # all JSON
    refused = [line for line in written if line["logger"] == "django.request"]
    assert refused and refused[0]["run_id"] == run_id
    assert any(line["logger"] == "gunicorn.access" for line in written)
    health = [line for line in written if "/healthz" in line["message"]]
    assert health and all("run_id" not in line for line in health)  # the next request: none
    assert secret not in text
