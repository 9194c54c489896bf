"""The control-plane image (``make control-plane-image``: scripts/image control-plane, built
from Dockerfile on covey-base:trixie): the project and its locked runtime dependencies, no
development or test tool, run unprivileged. Containers carry a label unique to the test."""

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from packaging.utils import canonicalize_name

from tests.locks import dev_only, locked

IMAGE = "covey:latest"

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
