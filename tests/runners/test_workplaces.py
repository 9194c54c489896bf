"""Workplaces on a real Docker engine: images built once with their packages and reused, and
companion services beside the sandbox, reachable by name from it and from nothing else.

The Debian packages come from the Debian archive (``hello``, and ``nodejs`` for npm's, fetched
once by scripts/test-debs), the Python and npm packages are made by the tests
(package_indexes); all are served on loopback: no mirror or registry is reached.
"""

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from runners.host.containers import builds, companions
from runners.host.containers.builds import BuildFailed, ImageBuilder
from runners.host.containers.engine import Engine, SandboxSpec, ServiceNotReady
from runners.protocol import Packages, Readiness, ServiceSpec
from tests.runners.conftest import Index

pytestmark = pytest.mark.docker

BASE = "covey-base:trixie"
WAIT = 60


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=120, check=check
    )


# --- images ------------------------------------------------------------------------------------


@pytest.fixture
def builder(apt_repository: Path, pip_index: Index, npm_registry: Index) -> ImageBuilder:
    """Builds on the host's network (the repositories are on loopback)."""
    return ImageBuilder(
        apt_sources=apt_repository,
        network="host",
        pip_index_url=pip_index.url,
        npm_registry=npm_registry.url,
    )


def test_a_workplace_image_is_built_once_with_its_packages_and_reused(builder: ImageBuilder):
    packages = [Packages("apt", ("hello",))]
    base_id = docker("image", "inspect", "--format", "{{.Id}}", BASE).stdout.strip()
    tag = f"{builds.REPOSITORY}:{builds.recipe_hash(base_id, packages)[:24]}"
    docker("rmi", "--force", tag, check=False)  # a leftover would hide the build
    try:
        started = time.monotonic()
        built = builder.image(BASE, packages, "test v1")
        took = time.monotonic() - started
        assert built == tag
        image_id = docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
        labels = json.loads(
            docker("image", "inspect", "--format", "{{json .Config.Labels}}", tag).stdout
        )
        assert labels[builds.LABEL_RECIPE] == builds.recipe_hash(base_id, packages)
        said = docker("run", "--rm", "--user", "1000:1000", tag, "hello").stdout
        assert said.strip() == "Hello, world!"
        # The base image has no hello: it came from the build.
        assert docker("run", "--rm", BASE, "sh", "-c", "command -v hello", check=False).returncode
        # Again: the same image, found, not built.
        started = time.monotonic()
        assert builder.image(BASE, packages, "again") == tag
        assert time.monotonic() - started < took
        assert docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip() == image_id
        # The image keeps the base's own apt sources, not the build's.
        sources = docker("run", "--rm", tag, "sh", "-c", "cat /etc/apt/sources.list.d/*").stdout
        assert "127.0.0.1" not in sources
    finally:
        docker("rmi", "--force", tag, check=False)


def test_pip_and_npm_packages_come_with_their_dependencies_and_commands(
    builder: ImageBuilder, pip_index: Index, npm_registry: Index
):
    packages = [Packages("pip", ("covey-greeting==1.0",)), Packages("npm", ("covey-greet@^1",))]
    tag = builder.image(BASE, packages, "test v3")
    try:
        # As the sandbox's user: the packages, their dependencies and their commands are there;
        # npm's came with Node.js (the base image has none).
        run = ["run", "--rm", "--user", "1000:1000", tag]
        assert docker(*run, "covey-greet").stdout == "hello from pip, dep 2.0\n"
        python = "import covey_greeting, covey_test_dep; print(covey_test_dep.WORD)"
        assert docker(*run, "python3", "-c", python).stdout == "dep 2.0\n"
        assert docker(*run, "covey-greet-js").stdout == "hello from npm, dep 2.0.0\n"
        node = "console.log(require('covey-greet').hello())"
        assert docker(*run, "node", "-e", node).stdout == "hello from npm, dep 2.0.0\n"
        # Owned by root: the agent uses them, and cannot change them.
        owners = docker(*run, "stat", "-c", "%U", builds.PYTHON, builds.NODE_MODULES).stdout
        assert owners.split() == ["root", "root"]
        assert docker("run", "--rm", BASE, "sh", "-c", "command -v node", check=False).returncode
        # npm's install scripts did not run on this host.
        assert not npm_registry.mark.exists()
        # The image is the same one next time.
        assert builder.image(BASE, packages, "again") == tag
    finally:
        docker("rmi", "--force", tag, check=False)


def test_pip_takes_wheels_alone_so_no_package_builds_on_the_host(
    builder: ImageBuilder, pip_index: Index
):
    with pytest.raises(BuildFailed) as failed:
        builder.image(BASE, [Packages("pip", ("covey-test-sdist==1.0",))], "sdist v1")
    assert "the pip packages of sdist v1 could not be fetched" in str(failed.value)
    assert "covey-test-sdist" in failed.value.log
    assert not pip_index.mark.exists()  # its setup.py never ran


def test_a_package_the_index_lacks_fails_the_build_naming_it(builder: ImageBuilder):
    with pytest.raises(BuildFailed) as failed:
        builder.image(BASE, [Packages("npm", ("covey-no-such-package@1.0.0",))], "npm v1")
    assert "the npm packages of npm v1 could not be fetched" in str(failed.value)
    assert "covey-no-such-package" in failed.value.log
    with pytest.raises(BuildFailed, match="No matching distribution found for covey-nothing"):
        builder.image(BASE, [Packages("pip", ("covey-nothing",))], "pip v1")


def test_no_packages_is_the_base_itself(builder: ImageBuilder):
    assert builder.image(BASE, [], "none") == BASE
    assert builder.image(BASE, [Packages("apt", ())], "none") == BASE


def test_a_build_that_fails_says_why_with_the_end_of_its_output(builder: ImageBuilder):
    with pytest.raises(BuildFailed) as failed:
        builder.image(BASE, [Packages("apt", ("covey-no-such-package",))], "broken v2")
    assert "the image of broken v2 could not be built" in str(failed.value)
    assert "Unable to locate package covey-no-such-package" in failed.value.log


def test_a_missing_base_image_is_named(builder: ImageBuilder):
    with pytest.raises(Exception, match="image covey-test-missing:1 is not on this host"):
        builder.image("covey-test-missing:1", [Packages("apt", ("hello",))])


# --- services ----------------------------------------------------------------------------------


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """A runner of its own; after each test nothing of it is left on the engine."""
    runner = f"test-{uuid4().hex[:8]}"
    made = Engine(runner)
    yield made
    left = docker(
        "ps", "--all", "--quiet", "--filter", f"label={companions.LABEL_PART_RUNNER}={runner}"
    ).stdout.split()
    left += docker(
        "ps", "--all", "--quiet", "--filter", f"label=covey.runner={runner}"
    ).stdout.split()
    networks = docker(
        "network", "ls", "--quiet", "--filter", f"label={companions.LABEL_PART_RUNNER}={runner}"
    ).stdout.split()
    if left:
        docker("rm", "--force", *left, check=False)
    if networks:
        docker("network", "rm", *networks, check=False)
    assert not left and not networks, f"left behind: {left} {networks}"


WEB = ServiceSpec(
    name="web",
    image=BASE,
    command=("python3", "-m", "http.server", "8080"),  # every address of its namespace
    ready=Readiness(
        command=(
            "python3",
            "-c",
            "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/')",
        ),
        interval=0.2,
        timeout=30,
    ),
    memory_mb=64,
)


def spec(tmp_path: Path, command: list[str], *services: ServiceSpec) -> SandboxSpec:
    return SandboxSpec(
        run_id=f"t{uuid4().hex[:12]}",
        agent_id=1,
        image=BASE,
        command=command,
        task="use the service",
        environment={},
        home=tmp_path / "homes" / uuid4().hex[:6],
        memory_mb=128,
        services=services,
    )


def test_a_service_is_ready_before_the_sandbox_starts_and_reachable_by_name(
    engine: Engine, tmp_path: Path
):
    run = spec(
        tmp_path,
        ["curl", "--silent", "--show-error", "--max-time", "5", "-o", "/dev/null",
         "-w", "%{http_code}", "http://web:8080/"],
        WEB,
    )  # fmt: skip
    sandbox = engine.launch(run)
    assert sandbox.image_id.startswith("sha256:")
    ended = engine.wait(run.run_id, WAIT)
    assert (ended.exit_code, engine.logs(run.run_id)) == (0, "200")
    (record,) = engine.services(run.run_id, logs=True)
    assert record.name == "web" and record.image_id.startswith("sha256:")
    assert record.ready_seconds is not None and record.ready_seconds < 30
    assert '"GET / HTTP/1.1" 200' in record.log  # the sandbox's request, in the service's log
    engine.remove(run.run_id)
    assert engine.runs_with_parts() == set()


def test_another_runs_sandbox_cannot_reach_the_services(engine: Engine, tmp_path: Path):
    first = spec(tmp_path, ["sleep", "60"], WEB)
    engine.launch(first)
    holder = json.loads(docker("inspect", companions.holder_name(first.run_id)).stdout)[0]
    (address,) = [n["IPAddress"] for n in holder["NetworkSettings"]["Networks"].values()]
    # Reached from the run's own sandbox's namespace at that address, to show it listens there.
    assert (
        docker(
            "exec",
            companions.service_name(first.run_id, "web"),
            "python3",
            "-c",
            f"import urllib.request as u; u.urlopen('http://{address}:8080/')",
        ).returncode
        == 0
    )
    other = spec(
        tmp_path,
        ["curl", "--silent", "--max-time", "3", "-o", "/dev/null", "-w", "%{http_code}",
         f"http://{address}:8080/"],
    )  # fmt: skip
    engine.launch(other)
    engine.wait(other.run_id, WAIT)
    assert engine.logs(other.run_id) == "000"  # no route to it from another sandbox
    # The host does not reach it either: nothing is published.
    assert holder["HostConfig"]["PortBindings"] in (None, {})
    for run in (first, other):
        engine.remove(run.run_id)


def test_a_service_never_ready_fails_the_launch_naming_it_with_its_log(
    engine: Engine, tmp_path: Path
):
    slow = ServiceSpec(
        name="db",
        image=BASE,
        command=("sh", "-c", "echo starting the database; exec sleep 60"),
        ready=Readiness(command=("false",), interval=0.2, timeout=1.5),
        memory_mb=32,
    )
    run = spec(tmp_path, ["true"], WEB, slow)
    with pytest.raises(ServiceNotReady) as failed:
        engine.launch(run)
    message = str(failed.value)
    assert message.startswith("service db did not become ready within 1.5 s")
    assert "starting the database" in message
    assert failed.value.record.name == "db"
    assert engine.get(run.run_id) is None
    assert engine.runs_with_parts() == set()  # the web service and the holder went too


def test_a_service_that_exits_fails_the_launch_at_once(engine: Engine, tmp_path: Path):
    broken = ServiceSpec(
        name="cache",
        image=BASE,
        command=("sh", "-c", "echo no config >&2; exit 3"),
        ready=Readiness(command=("true",), start_period=0.5, timeout=30),
        memory_mb=32,
    )
    run = spec(tmp_path, ["true"], broken)
    started = time.monotonic()
    with pytest.raises(ServiceNotReady, match=r"service cache exited \(code 3\).*no config"):
        engine.launch(run)
    assert time.monotonic() - started < 10
    assert engine.runs_with_parts() == set()
