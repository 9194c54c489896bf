"""Workplace images: a base image with a workplace's packages installed, built once per content
and reused.

The image is tagged ``covey-workplace:<hash>``, the hash of what decides its content (the base
image's ID, not its name: a rebuilt base makes a new image; the packages; this recipe's
version), so every run of one workplace version on one host runs the same image, and a second
run finds it built. The build runs on the runner host, outside any sandbox and before one is
made, with Docker's builder: nothing the agent controls takes part.

apt installs from the base image's own sources, or from ``apt_sources`` (a sources.list file on
the runner host, COVEY_WORKPLACE_APT_SOURCES: an internal mirror) used for the build alone. The
build container is on Docker's default bridge unless ``network`` says otherwise
(COVEY_WORKPLACE_BUILD_NETWORK).

pip and npm packages are fetched on the runner host (where a container may not reach or trust an
index) and copied in, and nothing of theirs runs on the host: pip takes wheels alone (an sdist
would run its build on the host), for the base image's Python, machine and C library, found by
running the image once; npm installs with ``--ignore-scripts``. In the image, pip installs the
wheels offline into a virtual environment, /opt/covey/python (with the system's site packages,
first on PATH); npm's tree goes to /usr/local (NODE_PATH names it, so ``require`` finds it), and
Debian's ``nodejs`` is installed with apt when the base image has no ``node``. The host's pip and
npm configuration applies, or ``pip_index_url`` and ``npm_registry``
(COVEY_WORKPLACE_PIP_INDEX_URL, COVEY_WORKPLACE_NPM_REGISTRY).

The docker SDK; no Django (runner hosts have no database).
"""

import dataclasses
import hashlib
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import docker
from docker.errors import APIError, ContainerError, DockerException, ImageNotFound

from runners.host.containers.engine import LABEL_INSTALLATION, EngineError
from runners.protocol import Packages

ECOSYSTEMS = ("apt", "pip", "npm")  # what this recipe installs (workplaces/config.py checks them)

REPOSITORY = "covey-workplace"
RECIPE = "2"  # what the Dockerfile below makes; a change to it makes new images
LABEL_RECIPE = "covey.workplace.recipe"  # the whole content hash
LABEL_WORKPLACE = "covey.workplace"  # which workplace version first built it, for people
BUILD_TIMEOUT = 1800  # seconds a build may take before it is given up
LOG_LINES = 40  # lines of a failed build's output kept with the run


class BuildFailed(EngineError):
    """The image could not be built; ``log`` is the end of the build's output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


PYTHON = "/opt/covey/python"  # the virtual environment pip packages go to
NODE_MODULES = "/usr/local/lib/node_modules"
# npm's names of machines (`uname -m`), for the packages that ship one build per machine.
NPM_CPUS = {
    "x86_64": "x64",
    "aarch64": "arm64",
    "armv7l": "arm",
    "ppc64le": "ppc64",
    "s390x": "s390x",
}
# What a base image offers packages: run in it once (as root, without a network) by /bin/sh.
PROBE = """
echo "machine=$(uname -m)"
command -v node >/dev/null 2>&1 && echo node=1
command -v python3 >/dev/null 2>&1 && python3 -c '
import ensurepip, os, platform, sys, venv
print("python=%d.%d" % sys.version_info[:2])
print("libc=" + (os.confstr("CS_GNU_LIBC_VERSION") or ""))
' 2>/dev/null
true
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """What a base image runs packages with: ``python`` ("3.13"; "" when it has no python3 with
    venv), its ``machine``, C library (``libc``, "glibc 2.41") and whether it has ``node``."""

    machine: str
    python: str = ""
    libc: str = ""
    node: bool = False

    @classmethod
    def parse(cls, output: str) -> "Target":
        found = dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
        return cls(
            machine=found.get("machine", "").strip(),
            python=found.get("python", "").strip(),
            libc=found.get("libc", "").strip(),
            node=found.get("node") == "1",
        )

    def pip_platforms(self) -> list[str]:
        """The platform tags of the wheels this target runs, newest first (as pip's own)."""
        kind, _, version = self.libc.partition(" ")
        major, _, minor = version.partition(".")
        if kind != "glibc" or major != "2" or not minor.isdigit():
            return []
        tags = [f"manylinux_2_{n}_{self.machine}" for n in range(int(minor), 4, -1)]
        if self.machine in ("x86_64", "i686", "aarch64", "armv7l", "ppc64", "ppc64le", "s390x"):
            tags.append(f"manylinux2014_{self.machine}")
        if self.machine in ("x86_64", "i686"):
            tags += [f"manylinux2010_{self.machine}", f"manylinux1_{self.machine}"]
        return tags


class ImageBuilder:
    """Builds and finds workplace images on one Docker engine (one per runner host)."""

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        *,
        apt_sources: Path | None = None,
        network: str | None = None,
        installation: str = "",
        pip_index_url: str = "",
        npm_registry: str = "",
    ) -> None:
        try:
            self._client = client if client is not None else docker.from_env(timeout=BUILD_TIMEOUT)
        except DockerException as exc:
            raise EngineError(f"cannot reach the Docker engine: {exc}") from exc
        self.apt_sources = apt_sources
        self.network = network
        self.installation = installation
        self.pip_index_url = pip_index_url
        self.npm_registry = npm_registry
        self._targets: dict[str, Target] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def image(self, base: str, packages: Sequence[Packages], what: str = "") -> str:
        """The tag of ``base`` with ``packages`` installed, built now if this host has none;
        ``base`` itself when there are no packages. BuildFailed saying why (with the end of
        the build's output) when it cannot be built."""
        wanted = [p for p in packages if p.specs]
        if not wanted:
            return base
        for group in wanted:
            if group.ecosystem not in ECOSYSTEMS:
                raise BuildFailed(f"this runner cannot install {group.ecosystem} packages")
        base_id = self._base_id(base)
        content = recipe_hash(base_id, wanted)
        tag = f"{REPOSITORY}:{content[:24]}"
        with self._lock(tag):
            if self._has(tag, content):
                return tag
            self._build(tag, content, base_id, wanted, what or base)
        return tag

    def _lock(self, tag: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(tag, threading.Lock())

    def _base_id(self, base: str) -> str:
        try:
            return str(self._client.images.get(base).id)
        except ImageNotFound:
            raise EngineError(
                f"image {base} is not on this host; build it (make base-image) or load it"
            ) from None
        except (APIError, DockerException) as exc:
            raise EngineError(f"cannot inspect image {base}: {exc}") from exc

    def _has(self, tag: str, content: str) -> bool:
        try:
            found = self._client.images.get(tag)
        except ImageNotFound:
            return False
        except (APIError, DockerException) as exc:
            raise EngineError(f"cannot inspect image {tag}: {exc}") from exc
        return bool((found.labels or {}).get(LABEL_RECIPE) == content)

    def _build(
        self, tag: str, content: str, base_id: str, packages: Sequence[Packages], what: str
    ) -> None:
        user = self._base_user(base_id)
        specs = {p.ecosystem: sorted(p.specs) for p in packages}
        labels = {LABEL_RECIPE: content, LABEL_WORKPLACE: what[:200]}
        if self.installation:
            labels[LABEL_INSTALLATION] = self.installation
        lines: list[str] = []
        with tempfile.TemporaryDirectory(prefix="covey-build-") as scratch:
            folders: dict[str, Path] = {}
            target = self._target(base_id, what) if {"pip", "npm"} & set(specs) else None
            if "pip" in specs and target is not None:
                folders["wheels"] = self._fetch_pip(
                    specs["pip"], target, Path(scratch), what, lines
                )
            if "npm" in specs and target is not None:
                folders["npm"] = self._fetch_npm(specs["npm"], target, Path(scratch), what, lines)
            text = dockerfile(base_id, packages, user, bool(self.apt_sources), target)
            with self._context(text, folders) as context:
                self._run_build(context, tag, labels, what, lines)
        if not self._has(tag, content):
            raise BuildFailed(
                f"the image of {what} was built but is not tagged {tag}",
                "\n".join(lines[-LOG_LINES:]),
            )

    def _run_build(
        self, context: IO[bytes], tag: str, labels: dict[str, str], what: str, lines: list[str]
    ) -> None:
        try:
            stream = self._client.api.build(
                fileobj=context,
                custom_context=True,
                tag=tag,
                labels=labels,
                rm=True,
                forcerm=True,
                pull=False,
                network_mode=self.network,
                decode=True,
            )
            for event in stream:
                if "stream" in event:
                    lines.extend(str(event["stream"]).splitlines())
                    del lines[: -LOG_LINES * 5]
                if "error" in event:
                    lines.append(str(event["error"]))
                    raise BuildFailed(
                        f"the image of {what} could not be built: {_last(lines, 3)}",
                        "\n".join(lines[-LOG_LINES:]),
                    )
        except (APIError, DockerException, OSError) as exc:
            raise BuildFailed(
                f"the image of {what} could not be built: {exc}", "\n".join(lines[-LOG_LINES:])
            ) from exc

    def _target(self, base_id: str, what: str) -> Target:
        """What the base image runs packages with (found once per image)."""
        if base_id not in self._targets:
            try:
                output = self._client.containers.run(
                    base_id,
                    entrypoint=["/bin/sh", "-c", PROBE],
                    command=[],
                    user="root",
                    network_mode="none",
                    remove=True,
                    stdout=True,
                    stderr=False,
                    labels={LABEL_INSTALLATION: self.installation} if self.installation else {},
                )
            except (ContainerError, APIError, DockerException) as exc:
                raise BuildFailed(
                    f"cannot run /bin/sh in the base image of {what} to see what it has: {exc}"
                ) from exc
            self._targets[base_id] = Target.parse(bytes(output).decode(errors="replace"))
        return self._targets[base_id]

    def _fetch_pip(
        self, specs: Sequence[str], target: Target, scratch: Path, what: str, lines: list[str]
    ) -> Path:
        """The wheels of ``specs`` and their dependencies, for ``target``, in a folder."""
        if not target.python:
            raise BuildFailed(
                f"pip packages need python3 with its venv module in the base image of {what},"
                " and it has none: use a base image that has them (on Debian, python3-venv),"
                " such as covey-base"
            )
        platforms = target.pip_platforms()
        if not platforms:
            raise BuildFailed(
                f"pip packages need a glibc system in the base image of {what}"
                f" (it has {target.libc or 'another C library'})"
            )
        # pip reads the environment markers of dependencies (python_version < "3.11",
        # platform_machine == ...) for the Python that runs it: it must be the image's.
        here = f"{sys.version_info[0]}.{sys.version_info[1]}"
        if (here, platform.machine()) != (target.python, target.machine):
            raise BuildFailed(
                f"pip packages are fetched by this runner host's Python {here} on"
                f" {platform.machine()}, and the base image of {what} has Python"
                f" {target.python} on {target.machine}: the dependencies pip chose would be"
                " those of the host's; use a base image with the host's Python"
            )
        into = scratch / "wheels"
        command = [
            sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
            "--progress-bar", "off", "--only-binary=:all:", "--implementation", "cp",
            "--python-version", target.python, "--dest", str(into),
        ]  # fmt: skip
        for tag in platforms:
            command += ["--platform", tag]
        index = {"PIP_INDEX_URL": self.pip_index_url} if self.pip_index_url else {}
        hint = (
            f"covey installs wheels alone, for Python {target.python} on {target.machine}"
            f" ({target.libc})"
        )
        _host([*command, "--", *specs], "pip", what, lines, scratch, index, hint)
        return into

    def _fetch_npm(
        self, specs: Sequence[str], target: Target, scratch: Path, what: str, lines: list[str]
    ) -> Path:
        """``specs`` and their dependencies installed under a prefix (lib/node_modules, bin)."""
        npm = shutil.which("npm")
        if npm is None:
            raise BuildFailed(
                f"this runner host has no npm to fetch the npm packages of {what} with:"
                " install npm on it"
            )
        into = scratch / "npm"
        # No scripts, and no git: npm runs a git dependency's prepare script even with
        # --ignore-scripts (npm/pacote#486); without git, such a dependency fails instead.
        command = [
            npm, "install", "--global", "--prefix", str(into), "--ignore-scripts", "--no-audit",
            "--no-fund", "--no-update-notifier", "--omit=dev", "--loglevel=warn", "--os=linux",
            f"--git={shutil.which('false') or '/bin/false'}",
        ]  # fmt: skip
        if target.machine in NPM_CPUS:
            command.append(f"--cpu={NPM_CPUS[target.machine]}")
        # --prefix moves where npm looks for its global npmrc (<prefix>/etc/npmrc): the host's
        # stays the one it reads (a CA file, a registry, credentials).
        if host_config := _npm_global_config(npm, scratch):
            command.append(f"--globalconfig={host_config}")
        registry = {"npm_config_registry": self.npm_registry} if self.npm_registry else {}
        _host([*command, "--", *specs], "npm", what, lines, scratch, registry)
        return into

    def _base_user(self, base_id: str) -> str:
        try:
            image = self._client.images.get(base_id)
        except (APIError, DockerException) as exc:
            raise EngineError(f"cannot inspect image {base_id}: {exc}") from exc
        return str(((image.attrs or {}).get("Config") or {}).get("User") or "")

    def _context(self, text: str, folders: dict[str, Path]) -> IO[bytes]:
        """The build context, in a temporary file: the Dockerfile, the apt sources when there
        are any, and ``folders`` by their names (symbolic links kept)."""
        files = {"Dockerfile": text.encode()}
        if self.apt_sources is not None:
            try:
                files["sources.list"] = self.apt_sources.read_bytes()
            except OSError as exc:
                raise BuildFailed(
                    f"cannot read the apt sources {self.apt_sources}"
                    f" (COVEY_WORKPLACE_APT_SOURCES): {exc}"
                ) from exc
        buffer = tempfile.TemporaryFile()  # noqa: SIM115 (the caller closes it)
        try:
            with tarfile.open(fileobj=buffer, mode="w") as archive:
                for name, data in files.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    info.mode = 0o644
                    archive.addfile(info, io.BytesIO(data))
                for name, folder in folders.items():
                    archive.add(folder, arcname=name, filter=_owned_by_root)
        except OSError as exc:
            buffer.close()
            raise BuildFailed(f"cannot make the build context: {exc}") from exc
        buffer.seek(0)
        return buffer


def _owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Root's, readable by everyone (whatever this host's umask made them), executable where
    they were, and nothing more."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    executable = info.isdir() or info.mode & 0o111
    info.mode = 0o755 if executable else 0o644
    return info


# What pip and npm see of the runner's environment: their own settings and the network's, not
# the runner's (its token, its database URL if it has one).
_PASSED = (
    "PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "NODE_EXTRA_CA_CERTS",
)  # fmt: skip
_PASSED_PREFIXES = ("PIP_", "NPM_CONFIG_", "npm_config_")
_PROXIES = ("http_proxy", "https_proxy", "no_proxy", "all_proxy")


def _environment(extra: dict[str, str]) -> dict[str, str]:
    kept = {
        key: value
        for key, value in os.environ.items()
        if key in _PASSED or key.startswith(_PASSED_PREFIXES) or key.lower() in _PROXIES
    }
    return {**kept, "PIP_NO_INPUT": "1", "npm_config_update_notifier": "false", **extra}


def _npm_global_config(npm: str, cwd: Path) -> str:
    """The global npmrc npm reads on this host, when there is one."""
    try:
        done = subprocess.run(  # noqa: S603 - npm itself, fixed arguments
            [npm, "config", "get", "globalconfig"],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=_environment({}),
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    path = done.stdout.decode(errors="replace").strip()
    return path if done.returncode == 0 and path and Path(path).is_file() else ""


def _host(
    command: list[str],
    what_tool: str,
    what: str,
    lines: list[str],
    cwd: Path,
    settings: dict[str, str] | None = None,
    hint: str = "",
) -> None:
    """Runs ``command`` (pip or npm) on the runner host, in ``cwd``, with ``settings`` in its
    environment (never on its command line, which the build's log shows); BuildFailed with its
    output's end (and ``hint``) if it fails. Its output joins ``lines`` (the build's log)."""
    try:
        done = subprocess.run(  # noqa: S603 - pip or npm, arguments checked before
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_environment(settings or {}),
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    except FileNotFoundError as exc:
        raise BuildFailed(f"this runner host cannot run {what_tool}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BuildFailed(
            f"fetching the {what_tool} packages of {what} took over {BUILD_TIMEOUT} s"
        ) from exc
    output = done.stdout.decode(errors="replace").splitlines()
    shown = command[3:] if what_tool == "pip" else command[1:]  # after "python -m pip"
    lines.append(f"$ {what_tool} " + " ".join(shlex.quote(arg) for arg in shown))
    lines.extend(output)
    del lines[: -LOG_LINES * 5]
    if done.returncode != 0:
        why = f"{_last(output, 3)} ({hint})" if hint else _last(output, 3)
        raise BuildFailed(
            f"the {what_tool} packages of {what} could not be fetched: {why}",
            "\n".join(lines[-LOG_LINES:]),
        )


def recipe_hash(base_id: str, packages: Sequence[Packages]) -> str:
    """What decides a workplace image's content, as a hex digest."""
    content = {
        "recipe": RECIPE,
        "base": base_id,
        "packages": {p.ecosystem: sorted(p.specs) for p in packages if p.specs},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def dockerfile(
    base_id: str,
    packages: Sequence[Packages],
    user: str,
    own_sources: bool,
    target: Target | None = None,
) -> str:
    """The Dockerfile of a workplace image (the packages are checked before this, and quoted
    here all the same). pip's wheels are in the context's ``wheels``, npm's tree in ``npm``."""
    specs = {p.ecosystem: sorted(set(p.specs)) for p in packages if p.specs}
    apt = specs.get("apt", [])
    if "npm" in specs and target is not None and not target.node:
        apt = sorted({*apt, "nodejs"})
    lines = [f"FROM {base_id}", "USER root"]
    if apt:
        lines += _apt_steps(apt, own_sources)
    if "pip" in specs:
        install = f"{PYTHON}/bin/python -m pip install --disable-pip-version-check --no-input"
        lines += [
            "COPY wheels /tmp/covey-build/wheels",
            "RUN "
            + " \\\n    && ".join(
                [
                    f"python3 -m venv --system-site-packages {PYTHON}",
                    f"{install} --no-cache-dir --no-index --find-links /tmp/covey-build/wheels"
                    " -- " + " ".join(shlex.quote(spec) for spec in specs["pip"]),
                    "rm -rf /tmp/covey-build",
                ]
            ),
            f"ENV PATH={PYTHON}/bin${{PATH:+:$PATH}}",
        ]
    if "npm" in specs:
        lines += [
            "COPY npm/ /usr/local/",
            f"ENV NODE_PATH={NODE_MODULES}${{NODE_PATH:+:$NODE_PATH}}",
        ]
    if user and user not in ("root", "0", "0:0"):
        lines.append(f"USER {user}")
    return "\n".join(lines) + "\n"


def _apt_steps(apt: Sequence[str], own_sources: bool) -> list[str]:
    options = ""
    lines = []
    if own_sources:
        # For the build alone: the image keeps its own sources.
        lines.append("COPY sources.list /tmp/covey-build/sources.list")
        options = (
            " -o Dir::Etc::SourceList=/tmp/covey-build/sources.list"
            " -o Dir::Etc::SourceParts=/tmp/covey-build/parts"
        )
    steps = [
        "mkdir -p /tmp/covey-build/parts",
        "export DEBIAN_FRONTEND=noninteractive",
        f"apt-get{options} -q update",
        f"apt-get{options} -q install -y --no-install-recommends -- "
        + " ".join(shlex.quote(spec) for spec in apt),
        "apt-get clean",
        "rm -rf /var/lib/apt/lists/* /tmp/covey-build",
    ]
    lines.append("RUN " + " \\\n    && ".join(steps))
    return lines


def _last(lines: list[str], count: int) -> str:
    shown = [line.strip() for line in lines if line.strip()][-count:]
    return " / ".join(shown) or "no output"
