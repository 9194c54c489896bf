"""What the hard-isolation tests share: the proxy image's session tag, the firewall's rules of a
runner, and a runner's leftovers (networks, proxy container, rules). The fixtures that use it
are in conftest.py."""

import json
import os
import shutil
import subprocess
from uuid import uuid4

import pytest

from runners.host.containers import isolation

IN_CI = os.environ.get("CI") == "true"
EGRESS_IMAGE = "covey-egress:latest"
SESSION = uuid4().hex[:8]
RUNNER = f"isotest-{SESSION}"
TEST_LABEL = f"covey.test=isolation-{SESSION}"
# A tag of this session only: the tests move it; other sessions may rebuild covey-egress:latest.
TAG = f"covey-isotest-{SESSION}:proxy"
NOWHERE = "http://127.0.0.1:9"  # the proxy's own loopback: no control plane answers
PROXY_ENV = {"COVEY_EGRESS_POLICY_GRACE": "1"}
WAIT = 30


def docker(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def inspect(name: str) -> dict:
    return json.loads(docker("inspect", name).stdout)[0]


def image_id(reference: str) -> str:
    return docker("image", "inspect", "--format", "{{.Id}}", reference).stdout.strip()


def unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def firewall_lines(runner: str) -> list[str]:
    """Every rule (iptables and ip6tables, all chains) carrying the runner's comment."""
    found = []
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary) is None:
            continue
        result = subprocess.run([binary, "-w", "10", "-S"], capture_output=True, text=True)
        found += [
            f"{binary} {line}"
            for line in result.stdout.splitlines()
            if f'"covey:{runner}"' in line or f"covey:{runner} " in line
        ]
    return found


def leftovers(runner: str) -> list[str]:
    """The runner's networks, proxy and rules that still exist."""
    names = {
        isolation.internal_network_name(runner),
        isolation.outward_network_name(runner),
    }
    networks = docker("network", "ls", "--format", "{{.Name}}").stdout.split()
    containers = docker("ps", "--all", "--format", "{{.Names}}").stdout.split()
    return (
        [f"network {n}" for n in networks if n in names]
        + [f"container {c}" for c in containers if c == isolation.proxy_container_name(runner)]
        + firewall_lines(runner)
    )
