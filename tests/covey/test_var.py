"""The var directory: made by an explicit step, never by importing settings (two gunicorn workers
once read a secret key the other had not finished writing, and the control plane answered 500)."""

import os
import subprocess
import sys

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
    assert sorted(p.name for p in directory.iterdir()) == ["broker", "secret_key", "static"]


def test_processes_preparing_at_once_all_read_the_same_whole_key(tmp_path):
    code = (
        "import sys, pathlib; from covey import var;"
        " print(var.secret_key(var.prepare(pathlib.Path(sys.argv[1]))))"
    )
    for attempt in range(3):
        directory = tmp_path / f"var-{attempt}"
        racing = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(directory)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        keys = {process.communicate(timeout=60)[0].strip() for process in racing}
        assert len(keys) == 1 and len(keys.pop()) >= 50
        assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []


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
