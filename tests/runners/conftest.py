"""Fixtures of the runner tests: hard isolation needs root, iptables and the proxy image;
workplace builds install packages from an apt repository, a Python package index and an npm
registry served here (package_indexes)."""

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runners import package_indexes
from tests.runners.isolation_support import EGRESS_IMAGE, TAG, TEST_LABEL, docker, unavailable
from tests.runners.stack import Stack


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


@pytest.fixture(scope="session")
def apt_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A flat apt repository of the packages scripts/test-debs fetched (Debian's hello, and
    nodejs with what it needs), served on loopback; yields a sources.list naming it (trusted:
    the test made it). No test reaches a mirror."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    cache_home = Path(cache) if cache.startswith("/") else Path.home() / ".cache"
    debs_dir = Path(os.environ.get("COVEY_TEST_DEBS") or cache_home / "covey/test-debs")
    debs = sorted(debs_dir.glob("*.deb"))
    if not any(deb.name.startswith("nodejs_") for deb in debs):
        pytest.fail(f"no nodejs_*.deb in {debs_dir}: run scripts/test-debs (make test-debs)")
    root = tmp_path_factory.mktemp("apt")
    package_indexes.apt_repository(root, debs)
    with package_indexes.serve(root) as url:
        sources = root.parent / f"{root.name}.list"
        sources.write_text(f"deb [trusted=yes] {url}/ ./\n")
        yield sources


@dataclass(frozen=True)
class Index:
    url: str  # what pip's --index-url or npm's --registry takes
    mark: Path  # appears if anything of a package ran on this host


@pytest.fixture(scope="session")
def pip_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Index]:
    """A simple index of test wheels (package_indexes.pip_index), served on loopback."""
    root = tmp_path_factory.mktemp("pypi")
    mark = root.parent / f"{root.name}-{package_indexes.MARK}"
    package_indexes.pip_index(root, mark)
    with package_indexes.serve(root) as url:
        yield Index(f"{url}/simple/", mark)


@pytest.fixture(scope="session")
def npm_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Index]:
    """An npm registry of test packages (package_indexes.npm_registry), served on loopback."""
    root = tmp_path_factory.mktemp("npm")
    mark = root.parent / f"{root.name}-{package_indexes.MARK}"
    documents = frozenset(f"/{name}" for name in package_indexes.NPM_PACKAGES)
    with package_indexes.serve(root, documents) as url:
        package_indexes.npm_registry(root, url, mark)
        yield Index(url, mark)


@pytest.fixture
def stack(tmp_path: Path, base_image: str) -> Iterator[Stack]:
    """A control plane and the runner processes a test starts (tests.runners.stack)."""
    built = Stack(tmp_path, base_image)
    yield built
    built.close()
