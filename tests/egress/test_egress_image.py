"""The egress proxy's image for runner hosts (``make egress-image``: scripts/image egress, built
from Dockerfile.egress on covey-base:trixie).

Uses the docker CLI, not the SDK: only runners/host/containers/ may import docker. Every
container a test starts carries a label unique to that test and is removed afterwards; no other
container is touched.
"""

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agents import services as agent_services
from egress.models import Decision, ProxySession
from egress.services import issue_token
from runners.host.client import ControlPlaneClient
from runners.services import create_registration_token
from tests.egress.conftest import ALLOWED_PRIVATE, Proxy, connect, subprocess_database_url
from tests.factories import OrganisationFactory
from tests.processes import control_plane, free_port, wait_for

IMAGE = "covey-egress:latest"
# How a runner host should run it: unprivileged, nothing writable but a tmpfs on /tmp.
LOCKED_DOWN = [
    "--init",  # the image has no init of its own: docker's passes signals on
    "--read-only",
    "--tmpfs",
    "/tmp",  # noqa: S108 (the container's own, where COVEY_VAR_DIR is)
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
]
# The image holds the proxy package and what it imports (its log lines too), nothing else (no
# Django project).
APP = {"allowlists", "egress", "jsonbodies", "logs", "status", "wire"}
SOURCES = {
    "allowlists/__init__.py", "allowlists/entries.py", "egress/__init__.py", "egress/policy.py",
    "logs/__init__.py", "status/__init__.py", "jsonbodies/__init__.py", "wire/__init__.py",
    "egress/protocol.py",
    "egress/environment.py", "egress/proxy/__init__.py", "egress/proxy/__main__.py",
    "egress/proxy/addon.py", "egress/proxy/answers.py", "egress/proxy/config.py",
    "egress/proxy/control_plane.py", "egress/proxy/desk.py", "egress/proxy/feed.py",
    "egress/proxy/front.py",
    "egress/proxy/layers.py", "egress/proxy/lookups.py", "egress/proxy/relay.py",
    "egress/proxy/resolver.py", "egress/proxy/server.py", "egress/proxy/status.py",
    "egress/proxy/tunnels.py",
}  # fmt: skip

# The dev group's own tools: none may be in an image.
DEV_TOOLS = {
    "mypy", "ruff", "pytest", "pytest-django", "pytest-xdist", "factory-boy", "faker", "trustme",
    "time-machine", "django-stubs", "djangorestframework-stubs", "import-linter", "grimp",
    "playwright", "dnslib", "uv", "types-psutil", "types-pyyaml",
}  # fmt: skip

pytestmark = pytest.mark.docker


def docker(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


@pytest.fixture(scope="module")
def image() -> str:
    """The image, which `make egress-image` builds (`make test` does, before the suite)."""
    result = docker("image", "inspect", IMAGE, check=False)
    if result.returncode != 0:
        message = f"no image {IMAGE}: run `make egress-image` ({result.stderr.strip()})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return IMAGE


@pytest.fixture
def run_label() -> Iterator[str]:
    """A label unique to this test; afterwards no container may carry it."""
    label = f"covey.test={uuid.uuid4().hex}"
    yield label
    left = docker("ps", "--all", "--quiet", "--filter", f"label={label}").stdout.split()
    if left:
        docker("rm", "--force", *left, check=False)
    assert not left, f"containers were left behind: {left}"


def run(image: str, run_label: str, *command: str) -> subprocess.CompletedProcess[str]:
    """Run a command in a locked-down, throwaway container of the image."""
    return docker(
        "run", "--rm", "--label", run_label, "--network", "none", *LOCKED_DOWN, image, *command,
        check=False,
    )  # fmt: skip


class ContainerProxy(Proxy):
    """A proxy in a container: its output is the container's (kept in the log file too)."""

    def __init__(self, port: int, log: Path, name: str) -> None:
        super().__init__(port, log)
        self.name = name

    def output(self) -> str:
        result = docker("logs", self.name, check=False)
        self.log.write_text(result.stdout + result.stderr)
        return result.stdout + result.stderr


@contextmanager
def proxy_container(
    image: str, run_label: str, tmp_path: Path, env: dict[str, str], *args: str
) -> Iterator[ContainerProxy]:
    """The image's proxy, locked down, on the host's network and a free loopback port, until
    the block ends; then the container is removed."""
    port = free_port()
    name = f"covey-test-egress-{uuid.uuid4().hex[:12]}"
    proxy = ContainerProxy(port, tmp_path / f"{name}.log", name)
    environment = [f"--env={key}={value}" for key, value in env.items()]
    command = ["python", "-m", "egress.proxy", "--listen", f"127.0.0.1:{port}", *args]
    try:
        docker(
            "run", "--detach", "--name", name, "--label", run_label, "--network", "host",
            *LOCKED_DOWN, *environment, image, *command,
        )  # fmt: skip

        def listening() -> bool:
            state = docker("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            output = proxy.output()
            assert state == "running", f"the container is {state}:\n{output}"
            return f"covey egress proxy listening on 127.0.0.1:{port}" in output

        wait_for(listening, 60, "the proxy in the container listening", proxy.log)
        yield proxy
    finally:
        docker("rm", "--force", name, check=False)


def test_the_image_carries_its_recipe_label(image):
    label = '{{index .Config.Labels "covey.recipe"}}'
    result = docker("image", "inspect", "--format", label, image)
    assert re.fullmatch(r"[0-9a-f]{64}", result.stdout.strip()), result.stdout


def test_the_proxy_command_runs_in_a_locked_down_container(image, run_label):
    result = run(image, run_label, "python", "-m", "egress.proxy", "--help")
    assert result.returncode == 0, result.stderr
    assert "--listen" in result.stdout
    assert "--runner-token" in result.stdout


def test_the_image_holds_the_proxy_alone_and_runs_it_unprivileged(image, run_label):
    result = run(image, run_label, "sh", "-c", "id -u; pwd; ls -A; find . -name '*.py' | sort")
    assert result.returncode == 0, result.stderr
    uid, workdir, *rest = result.stdout.split()
    assert uid != "0"
    assert workdir == "/app"
    entries = {e for e in rest if not e.startswith("./")}
    assert entries == APP  # no manage.py, tests/, .git, .venv, var/ or secrets
    assert {e.removeprefix("./") for e in rest if e.startswith("./")} == SOURCES


def test_the_image_installs_what_the_proxy_runs_and_no_tool(image, run_label):
    """requirements/proxy.txt, locked from the proxy group: no Django, no test or lint tool."""
    listing = (
        "import importlib.metadata as m; print(*sorted(d.name.lower() for d in m.distributions()))"
    )
    result = run(image, run_label, "python", "-c", listing)
    assert result.returncode == 0, result.stderr
    installed = set(result.stdout.split())
    assert {"mitmproxy", "dnspython", "httpx", "idna", "django-environ"} <= installed
    assert not installed & DEV_TOOLS, installed & DEV_TOOLS
    assert not installed & {"django", "djangorestframework", "celery", "docker", "psycopg"}
    assert not installed & {"pip", "setuptools"}  # nothing installs anything there


def test_the_proxy_refuses_everything_while_the_control_plane_is_unreachable(
    image, run_label, tmp_path
):
    """Policy from a control plane that does not answer: the proxy starts, and once the grace
    period has passed refuses every tunnel (fail closed), saying why."""
    env = {
        "COVEY_CONTROL_PLANE_URL": "http://127.0.0.1:9",  # nothing listens on port 9
        "COVEY_RUNNER_TOKEN": "x",
        "COVEY_EGRESS_POLICY_GRACE": "1",
    }
    with proxy_container(image, run_label, tmp_path, env) as proxy:
        assert "policy from http://127.0.0.1:9" in proxy.output()
        time.sleep(1.5)  # the grace period, and then some
        answer = connect(proxy, "example.com:443", None)
        answer.sock.close()
        assert answer.status == 503, (answer, proxy.output())
        assert answer.headers["x-covey-deny-reason"] == "policy-unavailable"

        # docker's init hands SIGTERM to the proxy, which shuts down cleanly.
        started = time.monotonic()
        docker("stop", "--time", "20", proxy.name)
        assert time.monotonic() - started < 15, proxy.output()
        exit_code = docker("inspect", "--format", "{{.State.ExitCode}}", proxy.name).stdout
        assert exit_code.strip() == "0", proxy.output()
        assert "Traceback" not in proxy.output(), proxy.output()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_proxy_enforces_the_control_planes_policy_without_a_database(
    image, run_label, net, tmp_path, django_db_setup
):
    """The runner host's setup, end to end: a registered runner's token, policy and decision log
    through the control plane's API, and no database in the container."""
    acme = OrganisationFactory(name="Acme")
    target = f"good.test:{net.tls.port}"
    agent = agent_services.create_agent(acme, "builder", allowlist=[target])
    _, credentials = issue_token(agent)
    _, secret = create_registration_token(acme)

    with control_plane(tmp_path, subprocess_database_url()) as url:
        runner = ControlPlaneClient.register(url, secret, "edge-1", ["eu"])
        env = {
            "COVEY_CONTROL_PLANE_URL": url,
            "COVEY_RUNNER_TOKEN": runner.token,
            "DATABASE_URL": "postgres://nobody@127.0.0.1:1/no-database-here",
            "COVEY_EGRESS_NAMESERVERS": net.dns.nameserver,
            "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": ALLOWED_PRIVATE,
            "COVEY_EGRESS_POLICY_POLL": "0.05",
        }
        with proxy_container(image, run_label, tmp_path, env, "--name", "edge-1") as proxy:

            def status(credentials: str | None) -> int:
                answer = connect(proxy, target, credentials)
                answer.sock.close()
                return answer.status

            wait_for(lambda: status(credentials) == 200, 15, "the tunnel allowed")
            assert status(None) == 407
            assert status("someone:wrong") == 407
            wait_for(
                lambda: Decision.objects.filter(agent=agent, proxy="edge-1").exists(),
                15,
                "the decision in the control plane's log",
            )
            # As the runner replaces its proxy: docker stop (SIGTERM) lets it write what it
            # decided and say it stopped, so its life in the log ends whole.
            docker("stop", "--time", "20", proxy.name)
            (session,) = ProxySession.objects.filter(proxy="edge-1")
            assert (session.end, session.gap) == (ProxySession.End.STOPPED, ""), proxy.output()
            decided = Decision.objects.filter(proxy="edge-1").count()
            assert session.made == session.recorded == decided >= 3
