"""The var directory: made by an explicit step, never by importing settings (two gunicorn workers
once read a secret key the other had not finished writing, and the control plane answered 500)."""

import os
import subprocess
import sys
import time

import pytest

from covey import var
from tests.processes import ROOT, VENV_BIN, free_port


def clean_env(var_dir) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SECRET_KEY", "DATABASE_URL")}
    return env | {"COVEY_VAR_DIR": str(var_dir), "CELERY_BROKER_URL": "filesystem://"}


def test_prepare_makes_the_folders_and_one_private_key_that_stays(tmp_path):
    directory = var.prepare(tmp_path / "var")
    key = var.secret_key(directory)
    assert len(key) >= 50
    assert (directory / var.SECRET_KEY_FILE).stat().st_mode & 0o777 == 0o600
    for name in var.BROKER_FOLDERS:
        assert var.broker_folder(directory, name).is_dir()
    var.prepare(directory)
    assert var.secret_key(directory) == key
    assert sorted(p.name for p in directory.iterdir()) == [
        "broker",
        "encryption_key",
        "secret_key",
        "static",
    ]


def test_processes_preparing_at_once_all_read_the_same_whole_key(tmp_path):
    """They wait for one moment to start together (Python's start-up would spread them out)."""
    code = (
        "import sys, time, pathlib; from covey import var;"
        " time.sleep(max(0.0, float(sys.argv[2]) - time.time()));"
        " print(var.secret_key(var.prepare(pathlib.Path(sys.argv[1]))))"
    )
    for attempt in range(2):
        directory = tmp_path / f"var-{attempt}"
        start = time.time() + 2
        racing = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(directory), str(start)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        keys = {process.communicate(timeout=60)[0].strip() for process in racing}
        assert len(keys) == 1 and len(keys.pop()) >= 50
        assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []


def test_whoever_names_the_key_second_keeps_the_first_and_leaves_no_draft(tmp_path, monkeypatch):
    directory = tmp_path / "var"
    directory.mkdir()
    link = os.link

    def another_process_first(source, target):
        (directory / var.SECRET_KEY_FILE).write_text("the-first-key")
        link(source, target)

    monkeypatch.setattr(var.os, "link", another_process_first)
    var.prepare(directory)
    assert var.secret_key(directory) == "the-first-key"
    assert sorted(p.name for p in directory.iterdir()) == [
        "broker",
        "encryption_key",
        "secret_key",
        "static",
    ]


def test_a_file_system_without_hard_links_is_said_and_nothing_is_left(tmp_path, monkeypatch):
    def no_links(source, target):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(var.os, "link", no_links)
    with pytest.raises(OSError, match=r"does not take hard links .*set DJANGO_SECRET_KEY"):
        var.prepare(tmp_path / "var")
    assert not [p for p in (tmp_path / "var").iterdir() if "secret" in p.name]


def test_importing_settings_writes_nothing(tmp_path):
    directory = tmp_path / "never-made"
    code = (
        "import django; django.setup(); from django.conf import settings; print(settings.VAR_DIR)"
    )
    env = clean_env(directory) | {"DJANGO_SETTINGS_MODULE": "covey.settings"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(directory)
    assert not directory.exists()


def test_the_web_server_refuses_to_start_without_a_key_and_says_where_one_comes_from(tmp_path):
    directory = tmp_path / "var"
    args = [str(VENV_BIN / "gunicorn"), "covey.wsgi", "--bind", f"127.0.0.1:{free_port()}"]
    result = subprocess.run(
        args, env=clean_env(directory), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "covey has no secret key: set DJANGO_SECRET_KEY, or run `python -m covey.var`" in (
        result.stderr
    )


def test_python_m_covey_var_prepares_the_configured_directory(tmp_path):
    directory = tmp_path / "var"
    result = subprocess.run(
        [sys.executable, "-m", "covey.var"],
        env=clean_env(directory),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(directory)
    assert var.secret_key(directory)


def test_celery_makes_the_file_system_brokers_folders_when_a_process_first_uses_it(tmp_path):
    """No step of its own: a web server or worker on a fresh COVEY_VAR_DIR can send at once."""
    directory = tmp_path / "fresh"
    code = (
        "import django; django.setup(); from covey.celery import app;"
        " app.send_task('covey.nothing')"
    )
    env = clean_env(directory) | {"DJANGO_SETTINGS_MODULE": "covey.settings"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert len(list(var.broker_folder(directory, "queue").iterdir())) == 1  # the message
    assert not (directory / var.SECRET_KEY_FILE).exists()  # and it made nothing else
