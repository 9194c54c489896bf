"""/healthz and /readyz of the control plane's web process, answered to anyone; and its /metrics
scraped from the real process."""

import httpx
import pytest
from django.db import OperationalError, connections
from prometheus_client.parser import text_string_to_metric_families

from covey.celery import app
from tests.egress.conftest import subprocess_database_url
from tests.processes import control_plane, free_port


def test_healthz_answers_without_asking_anything(client):
    answer = client.get("/healthz")
    assert (answer.status_code, answer.json()) == (200, {"status": "ok"})
    assert client.head("/healthz").status_code == 200
    assert client.post("/healthz").status_code == 405


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.django_db
def test_readyz_is_ready_when_the_database_and_the_broker_answer(client):
    answer = client.get("/readyz")
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok"}}


@pytest.mark.django_db
def test_readyz_names_a_broker_that_does_not_answer_and_never_its_address(
    client, monkeypatch, caplog
):
    port = free_port()  # nothing listens there
    broker = f"redis://:hunter2secret@127.0.0.1:{port}/0"
    monkeypatch.setenv("CELERY_BROKER_URL", broker)  # Celery reads it before its settings
    monkeypatch.setattr(app.conf, "broker_url", broker)
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert answer.json()["checks"]["broker"] == "unreachable"
    assert str(port) not in answer.content.decode() and "hunter2" not in answer.content.decode()
    assert f"127.0.0.1:{port}" in caplog.text and "hunter2secret" not in caplog.text


@pytest.mark.django_db
def test_readyz_names_a_database_that_does_not_answer(client, monkeypatch):
    def down(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(connections["default"], "cursor", down)
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert answer.json()["checks"]["database"] == "unreachable"


@pytest.mark.e2e  # a control plane of its own
@pytest.mark.postgres
def test_the_web_process_serves_them_without_a_session_or_token(tmp_path, django_db_setup):
    """The real process (gunicorn), on a database it migrated (the test database), with a
    broker that does not answer: alive, and not ready, saying why."""
    broker = f"redis://127.0.0.1:{free_port()}/0"
    token = "scrape-" + "x" * 24
    with control_plane(
        tmp_path, subprocess_database_url(), CELERY_BROKER_URL=broker, COVEY_METRICS_TOKEN=token
    ) as url:
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        ready = httpx.get(f"{url}/readyz", timeout=20)
        # Its metrics, scraped as Prometheus does, parse, and read the database.
        assert httpx.get(f"{url}/metrics").status_code in (401, 403)
        scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert scraped.status_code == 200, scraped.text
    families = {family.name for family in text_string_to_metric_families(scraped.text)}
    assert {"covey_runs", "covey_run_oldest_queued_seconds", "covey_requests_pending"} <= families
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "not ready",
        "checks": {"database": "ok", "broker": "unreachable"},
    }
