"""The base image sandboxes run on (``make base-image``, scripts/base-image).

Uses the docker CLI, not the SDK: only runners/host/containers/ may import docker.
"""

import re
import subprocess
import uuid

import pytest

IMAGE = "covey-base:trixie"
# How sandboxes are started: unprivileged, nothing writable but what is mounted.
LOCKED_DOWN = [
    "--user",
    "1000:1000",
    "--read-only",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--network",
    "none",
]

pytestmark = pytest.mark.docker


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=30, check=check
    )


@pytest.fixture
def run_label():
    """A label unique to this test; afterwards no container may carry it."""
    label = f"covey.test={uuid.uuid4().hex}"
    yield label
    left = docker("ps", "--all", "--quiet", "--filter", f"label={label}").stdout.split()
    if left:
        docker("rm", "--force", *left, check=False)
    assert not left, f"containers were left behind: {left}"


def test_the_image_exists_with_its_recipe_label():
    result = docker(
        "image",
        "inspect",
        "--format",
        '{{index .Config.Labels "covey.recipe"}}',
        IMAGE,
        check=False,
    )
    assert result.returncode == 0, f"no image {IMAGE}: run `make base-image` ({result.stderr})"
    assert re.fullmatch(r"[0-9a-f]{64}", result.stdout.strip()), result.stdout


def test_python_runs_as_agent_in_a_locked_down_container(run_label):
    script = "import os, pathlib; print(os.getuid(), os.getgid(), pathlib.Path.home())"
    result = docker(
        "run", "--rm", "--label", run_label, *LOCKED_DOWN, IMAGE, "python3", "-c", script
    )
    assert result.stdout.split() == ["1000", "1000", "/home/agent"]


def test_python_is_new_enough_for_covey(run_label):
    """Django 6.1, and so covey and its egress proxy, need Python 3.12+."""
    result = docker(
        "run",
        "--rm",
        "--label",
        run_label,
        *LOCKED_DOWN,
        IMAGE,
        "python3",
        "-c",
        "import sys; assert sys.version_info >= (3, 12), sys.version",
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_a_failing_container_is_removed_too(run_label):
    result = docker(
        "run",
        "--rm",
        "--label",
        run_label,
        *LOCKED_DOWN,
        IMAGE,
        "sh",
        "-c",
        "touch /x",
        check=False,
    )
    assert result.returncode != 0
    assert "Read-only file system" in result.stderr
