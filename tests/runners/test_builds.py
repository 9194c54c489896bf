"""The workplace image recipe without Docker: what the Dockerfile says, what pip and npm are
given (and not given) on the runner host, and which base images pip packages cannot go on."""

import io
import platform
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from runners.host.containers import builds
from runners.host.containers.builds import BuildFailed, ImageBuilder, Target
from runners.protocol import Packages

HERE = Target(
    machine=platform.machine(),
    python=f"{sys.version_info[0]}.{sys.version_info[1]}",
    libc="glibc 2.41",
)


def test_the_dockerfile_adds_to_the_base_images_paths_and_installs_nodejs_only_when_missing():
    packages = [Packages("pip", ("pyyaml==6.0.2",)), Packages("npm", ("left-pad@1.3.0",))]
    text = builds.dockerfile("sha256:abc", packages, "agent", False, HERE)
    assert "ENV PATH=/opt/covey/python/bin${PATH:+:$PATH}" in text  # never a trailing ':'
    assert "ENV NODE_PATH=/usr/local/lib/node_modules${NODE_PATH:+:$NODE_PATH}" in text
    assert "install -y --no-install-recommends -- nodejs" in text
    assert "--no-index --find-links /tmp/covey-build/wheels -- pyyaml==6.0.2" in text
    assert text.rstrip().endswith("USER agent")
    with_node = Target(machine=HERE.machine, python=HERE.python, libc=HERE.libc, node=True)
    assert "apt-get" not in builds.dockerfile("sha256:abc", packages, "", False, with_node)


def test_pip_needs_the_hosts_python_because_it_reads_markers_for_it(tmp_path):
    builder = ImageBuilder(client=object())
    other = Target(machine=HERE.machine, python="3.9", libc="glibc 2.41")
    with pytest.raises(BuildFailed, match=r"this runner host's Python 3\.\d+ .* has Python 3\.9"):
        builder._fetch_pip(["pyyaml"], other, tmp_path, "dev v2", [])
    musl = Target(machine=HERE.machine, python=HERE.python, libc="")
    with pytest.raises(BuildFailed, match="need a glibc system"):
        builder._fetch_pip(["pyyaml"], musl, tmp_path, "dev v2", [])
    with pytest.raises(BuildFailed, match="python3 with its venv module"):
        builder._fetch_pip(["pyyaml"], Target(machine=HERE.machine), tmp_path, "dev v2", [])


def test_pip_and_npm_see_their_settings_not_the_runners(monkeypatch):
    monkeypatch.setenv("COVEY_RUNNER_TOKEN", "secret-token")
    monkeypatch.setenv("DATABASE_URL", "postgres://secret")
    monkeypatch.setenv("PIP_TIMEOUT", "30")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    seen = builds._environment({"PIP_INDEX_URL": "https://user:pw@mirror.internal/simple"})
    assert "COVEY_RUNNER_TOKEN" not in seen and "DATABASE_URL" not in seen
    assert seen["PIP_TIMEOUT"] == "30" and seen["HTTPS_PROXY"] == "http://proxy.internal:3128"
    assert seen["PIP_INDEX_URL"].startswith("https://user:pw@")  # in the environment alone


def test_an_index_url_is_never_on_the_logged_command_line(tmp_path):
    lines: list[str] = []
    command = [sys.executable, "-c", "import os, sys; sys.exit(3)"]
    settings = {"PIP_INDEX_URL": "https://user:pw@mirror.internal/simple"}
    with pytest.raises(BuildFailed) as failed:
        builds._host(command, "python", "dev v1", lines, tmp_path, settings)
    assert "pw@" not in "\n".join(lines) and "pw@" not in failed.value.log


def test_the_context_is_roots_and_readable_whatever_the_umask(tmp_path):
    tree = tmp_path / "npm"
    (tree / "lib").mkdir(parents=True)
    (tree / "lib" / "index.js").write_text("x")
    (tree / "lib" / "cli.js").write_text("#!/usr/bin/env node\n")
    (tree / "lib").chmod(0o700)
    (tree / "lib" / "index.js").chmod(0o600)
    (tree / "lib" / "cli.js").chmod(0o4700)
    builder = ImageBuilder(client=object())
    with (
        builder._context("FROM x\n", {"npm": tree}) as context,
        tarfile.open(fileobj=io.BytesIO(context.read())) as archive,
    ):
        modes = {m.name: (m.mode, m.uid, m.uname) for m in archive.getmembers()}
    assert modes["npm/lib"] == (0o755, 0, "root")
    assert modes["npm/lib/index.js"] == (0o644, 0, "root")
    assert modes["npm/lib/cli.js"] == (0o755, 0, "root")  # executable, and no setuid
    assert set(modes) == {"Dockerfile", "npm", "npm/lib", "npm/lib/index.js", "npm/lib/cli.js"}


def test_the_probe_output_is_read(tmp_path: Path):
    found = Target.parse("machine=x86_64\nnode=1\npython=3.13\nlibc=glibc 2.41\n")
    assert found == Target(machine="x86_64", python="3.13", libc="glibc 2.41", node=True)
    assert found.pip_platforms()[:2] == ["manylinux_2_41_x86_64", "manylinux_2_40_x86_64"]
    assert found.pip_platforms()[-3:] == [
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ]
    assert Target.parse("machine=aarch64\n") == Target(machine="aarch64")


def test_npm_keeps_reading_the_hosts_global_npmrc_under_its_own_prefix(tmp_path, monkeypatch):
    """--prefix moves the global npmrc npm looks for (to <prefix>/etc/npmrc): the build names
    the host's own, where a CA file or a mirror may be set."""
    npmrc = tmp_path / "npmrc"
    npmrc.write_text("fund=false\n")
    monkeypatch.setenv("npm_config_globalconfig", str(npmrc))
    assert builds._npm_global_config(str(shutil.which("npm")), tmp_path) == str(npmrc)
    commands: list[list[str]] = []
    monkeypatch.setattr(builds, "_host", lambda command, *args, **kwargs: commands.append(command))
    builder = ImageBuilder(client=object())
    builder._fetch_npm(["left-pad@1.3.0"], HERE, tmp_path, "dev v1", [])
    assert f"--globalconfig={npmrc}" in commands[0]
    assert "--git=" + (shutil.which("false") or "/bin/false") in commands[0]
