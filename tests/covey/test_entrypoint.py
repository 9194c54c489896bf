"""The image's entry point (covey/entrypoint.py): what each role becomes, what it waits for,
and what it says when that does not come. The image itself runs it in
test_control_plane_image.py."""

import pytest

from covey import entrypoint, health


def test_each_role_becomes_its_program_with_the_settings_it_reads():
    assert entrypoint.command("web", [], {}) == [
        *["gunicorn", "covey.wsgi", "--bind", "0.0.0.0:8000", "--workers", "2"],
        *["--access-logfile", "-", "--forwarded-allow-ips="],
    ]
    web = entrypoint.command(
        "web",
        ["--timeout", "60"],
        {
            "COVEY_BIND": "[::]:9000",
            "COVEY_WEB_WORKERS": "5",
            "COVEY_FORWARDED_ALLOW_IPS": "10.0.0.1",
        },
    )
    assert web[3] == "[::]:9000" and web[5] == "5"
    assert web[-3:] == ["--forwarded-allow-ips=10.0.0.1", "--timeout", "60"]
    assert entrypoint.command("worker", [], {"COVEY_WORKER_CONCURRENCY": "4"}) == [
        *["celery", "--app", "covey", "worker", "--beat", "--loglevel", "INFO"],
        *["--concurrency", "4"],
    ]
    assert entrypoint.command("runner", [], {}) == ["python", "manage.py", "runner", "--builtin"]
    assert entrypoint.command("runner", ["--config", "/r.json"], {})[-2:] == ["--config", "/r.json"]
    assert entrypoint.command("proxy", [], {})[2:] == ["egress_proxy", "--listen", "0.0.0.0:3128"]
    assert entrypoint.command("gateway", [], {"COVEY_MODEL_GATEWAY_LISTEN": "0.0.0.0:9"})[-1] == (
        "0.0.0.0:9"
    )
    with pytest.raises(entrypoint.EntrypointError, match="no role 'cook'"):
        entrypoint.command("cook", [], {})


def test_a_broker_that_does_not_answer_is_named_without_its_password(monkeypatch):
    from covey.celery import app
    from tests.processes import free_port

    port = free_port()  # nothing listens there
    broker = f"redis://:s3cret@127.0.0.1:{port}/0"
    monkeypatch.setenv("CELERY_BROKER_URL", broker)  # Celery reads it before its settings
    monkeypatch.setattr(app.conf, "broker_url", broker)
    why = health.broker_problem()
    assert why.startswith(f"the broker at redis://:**@127.0.0.1:{port}/0 does not answer (")
    assert "s3cret" not in why


def test_waiting_says_what_it_waits_for_once_and_gives_up_with_the_last_reason(capsys):
    answers = iter(["the database at db:5432 does not answer (refused)"] * 3 + [""])
    entrypoint.wait("the database", lambda: next(answers), seconds=10, pause=0)
    said = capsys.readouterr().err.splitlines()
    assert said == [
        "covey: waiting for the database: the database at db:5432 does not answer (refused)",
        "covey: the database is ready",
    ]
    with pytest.raises(entrypoint.EntrypointError) as raised:
        entrypoint.wait("the broker", lambda: "the broker at redis://redis:6379/0 says no", 0, 0)
    assert str(raised.value) == (
        "the broker is not ready after 0 s: the broker at redis://redis:6379/0 says no"
    )


def test_a_word_that_is_no_role_nor_program_is_refused(capsys):
    assert entrypoint.main(["cook"], {}) == 2
    assert "'cook' is no role (web, worker, runner, proxy, gateway, stream, migrate)" in (
        capsys.readouterr().err
    )


@pytest.mark.django_db
def test_the_database_and_the_migrations_are_ready_in_the_tests_database():
    assert health.database_problem() == ""
    assert entrypoint.migrations_applied() == ""


def test_a_role_with_the_database_refuses_to_start_without_the_keys_given(capsys):
    assert entrypoint.main(["worker"], {"DJANGO_SECRET_KEY": "k"}) == 1
    assert capsys.readouterr().err == (
        "covey: worker: COVEY_ENCRYPTION_KEYS not set: every process of an installation needs"
        " the same keys, made once (scripts/compose-env writes them into .env)\n"
    )
    assert entrypoint.missing_keys("web", {}) == ["DJANGO_SECRET_KEY", "COVEY_ENCRYPTION_KEYS"]
    assert entrypoint.missing_keys("runner", {}) == []
