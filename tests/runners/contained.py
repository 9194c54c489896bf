"""A runner host in a container: a Docker engine of its own (dockerd inside, its containers,
networks and firewall rules in the container's network namespace) and the runner process
beside it, from the control-plane image. A test may stop and start that engine, as an upgrade
or a crash and its supervisor would, and touch nothing else on this machine.

It needs no --privileged (root here lacks CAP_SYS_RESOURCE, which that would ask for): every
capability but that one, no seccomp or AppArmor profile, the host's cgroups, and tmpfs for the
engine's files (overlay2 works on it). Its engine reaches this machine's addresses (the test
world: the control plane's relay, the DNS server, the upstream) through its own NAT;
``host.docker.internal`` inside its containers means the world's address.
"""

import hashlib
import json
import subprocess
import time
from pathlib import Path
from uuid import uuid4

from tests.processes import wait_for
from tests.runners.stack import docker

IMAGE_LABEL = "covey.test.image=runner-host"
# The engine's packages once (cached while the base image stays), then covey's virtualenv and
# code from the control-plane image (`make control-plane-image`).
DOCKERFILE = """\
ARG BASE
FROM ${BASE} AS engine
RUN apt-get -q update \\
    && DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends \\
        docker.io docker-cli iptables iproute2 \\
    && rm -rf /var/lib/apt/lists/*
FROM engine
COPY --from=CONTROL_PLANE /opt/covey /opt/covey
COPY --from=CONTROL_PLANE /app /app
ENV PATH=/opt/covey/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
"""


def runner_host_image(base_image: str, control_plane_image: str) -> str:
    """The image, built when its inputs changed (a tag per their IDs)."""
    ids = [
        docker("image", "inspect", "--format", "{{.Id}}", image).strip()
        for image in (base_image, control_plane_image)
    ]
    key = hashlib.sha256("\n".join([*ids, DOCKERFILE]).encode()).hexdigest()[:12]
    tag = f"covey-test-runner-host:{key}"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    built = subprocess.run(
        ["docker", "build", "--quiet", "--label", IMAGE_LABEL, "--build-arg",
         f"BASE={base_image}", "--tag", tag, "-"],
        input=DOCKERFILE.replace("CONTROL_PLANE", control_plane_image),
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    # Older builds of it go (the engine's stage stays as the new one's cache).
    for old in docker("images", "--quiet", "--filter", f"label={IMAGE_LABEL}").split():
        if old not in docker("image", "inspect", "--format", "{{.Id}}", tag):
            subprocess.run(["docker", "image", "rm", old], capture_output=True)
    return tag


class ContainedHost:
    """The container (its name and label carry this test's id), its engine, its runner."""

    def __init__(self, image: str, host_gateway: str, work: Path) -> None:
        self.name = f"covey-test-runner-host-{uuid4().hex[:8]}"
        self.work = work  # mounted at /work: the runner's config, its files, its log
        self.work.mkdir(parents=True, exist_ok=True)
        self.host_gateway = host_gateway
        docker(
            "run", "--detach", "--init", "--name", self.name,
            "--label", f"covey.test=runner-host-{self.name}",
            "--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE",
            "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
            "--security-opt", "systempaths=unconfined", "--cgroupns", "host",
            "--volume", "/sys/fs/cgroup:/sys/fs/cgroup:rw",
            "--tmpfs", "/var/lib/docker:exec,size=6g", "--tmpfs", "/run:exec",
            "--volume", f"{self.work}:/work",
            "--add-host", "host.docker.internal:host-gateway",
            image, "sleep", "infinity",
        )  # fmt: skip
        self.engine_starts = 0

    def exec(self, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", "exec", *kwargs.pop("options", ()), self.name, *args],
            capture_output=True, text=True, timeout=kwargs.pop("timeout", 120), check=check,
            **kwargs,
        )  # fmt: skip

    # --- the engine --------------------------------------------------------------------------

    def start_engine(self) -> None:
        self.engine_starts += 1
        self.exec(
            "sh", "-c",
            f"exec dockerd --host-gateway-ip={self.host_gateway}"
            f" >>/work/dockerd-{self.engine_starts}.log 2>&1",
            options=("--detach",),
        )  # fmt: skip
        wait_for(self.engine_answers, 60, "the contained engine answering", self.engine_log())

    def engine_answers(self) -> bool:
        return self.exec("docker", "info", check=False, timeout=10).returncode == 0

    def stop_engine(self) -> float:
        """SIGTERM to dockerd, as a service manager stops it (it stops its containers, then
        exits); seconds it took."""
        started = time.monotonic()
        self.exec("sh", "-c", "kill -TERM $(cat /var/run/docker.pid)")
        wait_for(
            lambda: self.exec("pgrep", "-x", "dockerd", check=False).returncode != 0,
            60,
            "the contained engine stopping",
        )
        return time.monotonic() - started

    def engine_log(self) -> Path:
        return self.work / f"dockerd-{self.engine_starts}.log"

    def load(self, *images: str) -> None:
        """Copy images from this machine's engine into the contained one."""
        saved = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        loaded = subprocess.run(
            ["docker", "exec", "-i", self.name, "docker", "load", "--quiet"],
            stdin=saved.stdout, capture_output=True, timeout=300, check=False,
        )  # fmt: skip
        assert saved.wait(timeout=60) == 0 and loaded.returncode == 0, loaded.stderr

    def docker(self, *args: str) -> str:
        return self.exec("docker", *args).stdout

    # --- the runner --------------------------------------------------------------------------

    def start_runner(self, config: dict, env: dict[str, str]) -> None:
        """``manage.py runner`` in the container, its output in the work folder."""
        (self.work / "runner.json").write_text(json.dumps(config))
        options = ["--detach"]
        for key, value in env.items():
            options += ["--env", f"{key}={value}"]
        self.exec(
            "sh", "-c",
            "exec python manage.py runner --config /work/runner.json >>/work/runner.log 2>&1",
            options=tuple(options),
        )  # fmt: skip
        wait_for(lambda: "taking orders" in self.runner_output(), 120, "the runner starting")

    def runner_output(self) -> str:
        log = self.work / "runner.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def close(self) -> None:
        """The container, and with it its engine, its runner and everything they made."""
        subprocess.run(["docker", "rm", "--force", "--volumes", self.name], capture_output=True)
