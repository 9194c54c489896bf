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

The docker SDK; no Django (runner hosts have no database).
"""

import hashlib
import io
import json
import shlex
import tarfile
import threading
from collections.abc import Sequence
from pathlib import Path

import docker
from docker.errors import APIError, DockerException, ImageNotFound

from runners.host.containers.engine import LABEL_INSTALLATION, EngineError
from runners.protocol import Packages

REPOSITORY = "covey-workplace"
RECIPE = "1"  # what the Dockerfile below makes; a change to it makes new images
LABEL_RECIPE = "covey.workplace.recipe"  # the whole content hash
LABEL_WORKPLACE = "covey.workplace"  # which workplace version first built it, for people
BUILD_TIMEOUT = 1800  # seconds a build may take before it is given up
LOG_LINES = 40  # lines of a failed build's output kept with the run


class BuildFailed(EngineError):
    """The image could not be built; ``log`` is the end of the build's output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


class ImageBuilder:
    """Builds and finds workplace images on one Docker engine (one per runner host)."""

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        *,
        apt_sources: Path | None = None,
        network: str | None = None,
        installation: str = "",
    ) -> None:
        try:
            self._client = client if client is not None else docker.from_env(timeout=BUILD_TIMEOUT)
        except DockerException as exc:
            raise EngineError(f"cannot reach the Docker engine: {exc}") from exc
        self.apt_sources = apt_sources
        self.network = network
        self.installation = installation
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
            if group.ecosystem != "apt":
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
        context = self._context(dockerfile(base_id, packages, user, bool(self.apt_sources)))
        labels = {LABEL_RECIPE: content, LABEL_WORKPLACE: what[:200]}
        if self.installation:
            labels[LABEL_INSTALLATION] = self.installation
        lines: list[str] = []
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
        if not self._has(tag, content):
            raise BuildFailed(
                f"the image of {what} was built but is not tagged {tag}",
                "\n".join(lines[-LOG_LINES:]),
            )

    def _base_user(self, base_id: str) -> str:
        try:
            image = self._client.images.get(base_id)
        except (APIError, DockerException) as exc:
            raise EngineError(f"cannot inspect image {base_id}: {exc}") from exc
        return str(((image.attrs or {}).get("Config") or {}).get("User") or "")

    def _context(self, text: str) -> io.BytesIO:
        """The build context: the Dockerfile, and the apt sources when there are any."""
        files = {"Dockerfile": text.encode()}
        if self.apt_sources is not None:
            try:
                files["sources.list"] = self.apt_sources.read_bytes()
            except OSError as exc:
                raise BuildFailed(
                    f"cannot read the apt sources {self.apt_sources}"
                    f" (COVEY_WORKPLACE_APT_SOURCES): {exc}"
                ) from exc
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o644
                archive.addfile(info, io.BytesIO(data))
        buffer.seek(0)
        return buffer


def recipe_hash(base_id: str, packages: Sequence[Packages]) -> str:
    """What decides a workplace image's content, as a hex digest."""
    content = {
        "recipe": RECIPE,
        "base": base_id,
        "packages": {p.ecosystem: sorted(p.specs) for p in packages if p.specs},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def dockerfile(base_id: str, packages: Sequence[Packages], user: str, own_sources: bool) -> str:
    """The Dockerfile of a workplace image (apt packages; they are checked before this, and
    quoted here all the same)."""
    apt = sorted({spec for p in packages if p.ecosystem == "apt" for spec in p.specs})
    options = ""
    lines = [f"FROM {base_id}", "USER root"]
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
    if user and user not in ("root", "0", "0:0"):
        lines.append(f"USER {user}")
    return "\n".join(lines) + "\n"


def _last(lines: list[str], count: int) -> str:
    shown = [line.strip() for line in lines if line.strip()][-count:]
    return " / ".join(shown) or "no output"
