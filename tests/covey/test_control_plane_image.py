"""The control-plane image (``make control-plane-image``: scripts/image control-plane, built
from Dockerfile on covey-base:trixie): the project and its locked runtime dependencies, no
development or test tool, run unprivileged. Containers carry a label unique to the test."""

import os
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
from packaging.utils import canonicalize_name

from tests.locks import dev_only, locked

IMAGE = "covey:latest"
# The keys every role with the database is given (test-only values).
KEYS = {
    "DJANGO_SECRET_KEY": "a-test-only-secret-key-long-enough-for-the-deploy-check-0123456789",
    "COVEY_ENCRYPTION_KEYS": "dGVzdC1vbmx5LWVuY3J5cHRpb24ta2V5LTMyLWJ5dGU=",
}

pytestmark = pytest.mark.docker


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=120, check=check
    )


@pytest.fixture(scope="module")
def image() -> str:
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        message = f"no image {IMAGE}: run `make control-plane-image`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return IMAGE


@pytest.fixture
def run(image) -> Iterator:
    label = f"covey.test={uuid.uuid4().hex}"

    def run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        environment = [f"--env={k}={v}" for k, v in (env or {}).items()]
        return docker(
            "run", "--rm", "--label", label, "--network", "none", "--cap-drop", "ALL",
            *environment, image, *command,
            check=False,
        )  # fmt: skip

    yield run
    left = docker("ps", "--all", "--quiet", "--filter", f"label={label}").stdout.split()
    if left:
        docker("rm", "--force", *left, check=False)
    assert not left


def test_it_installs_the_locked_runtime_dependencies_and_no_tool(run):
    listing = "import importlib.metadata as m; print(*sorted(d.name for d in m.distributions()))"
    result = run("python", "-c", listing)
    assert result.returncode == 0, result.stderr
    installed = {canonicalize_name(name) for name in result.stdout.split()}
    # The lock is universal: what other platforms or Pythons need is left out here.
    assert installed <= set(locked("control-plane")), installed - set(locked("control-plane"))
    assert {"django", "celery", "docker", "mitmproxy", "gunicorn"} <= installed
    assert not installed & dev_only(), installed & dev_only()
    assert "pip" not in installed


def test_it_holds_the_project_without_tests_and_runs_unprivileged(run):
    result = run("sh", "-c", "id -u; pwd; ls -A; ls static/admin/css | head -1")
    assert result.returncode == 0, result.stderr
    uid, workdir, *entries = result.stdout.split()
    assert uid != "0" and workdir == "/app"
    assert "manage.py" in entries and "runs" in entries and "organisations" in entries
    assert not {"tests", ".git", ".venv", "var", "bench"} & set(entries)
    assert entries[-1].endswith(".css")  # static files collected at build time


def test_its_checks_pass_with_a_production_configuration(run):
    env = {
        "DJANGO_SECRET_KEY": "a-test-only-secret-key-long-enough-for-the-deploy-check-0123456789",
        "DATABASE_URL": "sqlite:////tmp/covey.sqlite3",
    }
    result = run("python", "manage.py", "check", env=env)
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout


def test_it_serves_the_web_role_by_default_migrated_with_its_first_admin(image):
    label = f"covey.test={uuid.uuid4().hex}"
    env = {"COVEY_ADMIN_PASSWORD": "given-not-shown", **KEYS}
    started = docker(
        "run", "--detach", "--label", label, "--network", "none", "--cap-drop", "ALL",
        *[f"--env={k}={v}" for k, v in env.items()], image,
    )  # fmt: skip
    container = started.stdout.strip()
    ask = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/readyz').read())"
    try:
        for _ in range(60):
            answer = docker("exec", container, "python", "-c", ask, check=False)
            if answer.returncode == 0:
                break
            time.sleep(0.5)
        assert '"status": "ready"' in answer.stdout, answer.stderr
        top = docker("top", container, "-o", "pid,args").stdout
        logs = docker("logs", container).stdout + docker("logs", container).stderr
    finally:
        stopped = docker("stop", "--time", "20", container, check=False)
        code = docker("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip()
        docker("rm", "--force", container, check=False)
    assert stopped.returncode == 0 and code == "0"  # gunicorn is PID 1: it got the SIGTERM
    assert "gunicorn covey.wsgi --bind 0.0.0.0:8000" in top
    assert "Applying runners." in logs and "renewed the tokens of 0 runner(s)" in logs
    assert "COVEY_ADMIN_PASSWORD" in logs and "given-not-shown" not in logs


def test_a_role_says_which_database_it_waits_for_and_never_its_password(run):
    env = {
        "DATABASE_URL": "postgres://covey:s3cret-pw@127.0.0.1:9/covey",
        "COVEY_WAIT_SECONDS": "1",
        **KEYS,
    }
    result = run("worker", env=env)
    assert result.returncode == 1
    assert "covey: worker: the database is not ready after 1 s" in result.stderr
    assert "the database at 127.0.0.1:9 does not answer" in result.stderr
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_the_migrate_role_needs_the_keys_migrates_and_exits_and_no_role_is_refused(run):
    refused = run("migrate")
    assert refused.returncode == 1
    assert "DJANGO_SECRET_KEY and COVEY_ENCRYPTION_KEYS not set" in refused.stderr
    result = run("migrate", env=KEYS)
    assert result.returncode == 0, result.stderr
    assert "Applying organisations." in result.stdout
    refused = run("cook")
    assert refused.returncode == 2 and "'cook' is no role" in refused.stderr


def test_the_web_role_refuses_settings_unfit_to_serve_before_it_changes_anything(run):
    refused = run("web", env={"DJANGO_DEBUG": "true", **KEYS})
    assert refused.returncode == 1
    assert "covey: web: the settings are not fit to serve" in refused.stderr
    assert "(covey.E004) DJANGO_DEBUG is on" in refused.stderr
    assert "Applying" not in refused.stdout  # nothing migrated
