"""Fixtures of the runner tests: hard isolation needs root, iptables and the proxy image."""

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.runners.isolation_support import EGRESS_IMAGE, TAG, TEST_LABEL, docker, unavailable


@pytest.fixture(scope="module")
def firewall() -> None:
    """Root and an iptables that lists Docker's DOCKER-USER chain."""
    if os.geteuid() != 0:
        unavailable("hard isolation needs root (it installs iptables rules)")
    if shutil.which("iptables") is None:
        unavailable("no iptables command (apt-get install iptables)")
    result = subprocess.run(
        ["iptables", "-w", "10", "-S", "DOCKER-USER"], capture_output=True, text=True
    )
    if result.returncode != 0:
        unavailable(f"iptables is unusable here: {result.stderr.strip()}")


@pytest.fixture(scope="module")
def egress_image(firewall: None) -> Iterator[str]:
    """This session's tag on the proxy image (`make egress-image` builds it)."""
    if shutil.which("docker") is None:
        unavailable("docker is required: no docker command")
    result = docker("image", "inspect", "--format", "{{.Id}}", EGRESS_IMAGE, check=False)
    if result.returncode != 0:
        unavailable(f"no image {EGRESS_IMAGE}: run `make egress-image` ({result.stderr.strip()})")
    docker("tag", result.stdout.strip(), TAG)
    yield TAG
    docker("image", "rm", TAG, check=False)  # the tag only: the image stays if tagged elsewhere
    derived = docker("images", "--quiet", "--filter", f"label={TEST_LABEL}").stdout.split()
    if derived:
        docker("image", "rm", "--force", *set(derived), check=False)
