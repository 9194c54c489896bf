"""Fixtures of the runner tests: hard isolation needs root, iptables and the proxy image;
workplace builds install a Debian package from a repository served here."""

import hashlib
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def apt_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Debian's hello, fetched once by scripts/test-services (make services): no test reaches
    # a mirror.
    """A flat apt repository with Debian's hello, served on loopback; yields a sources.list
    naming it (trusted: the test made it)."""
    debs_dir = Path(os.environ.get("COVEY_TEST_DEBS", Path.home() / ".cache/covey/test-debs"))
    debs = sorted(debs_dir.glob("hello_*.deb"))
    if not debs:
        pytest.fail(f"no hello_*.deb in {debs_dir}: run scripts/test-services (make services)")
    root = tmp_path_factory.mktemp("apt")
    deb = root / debs[-1].name
    shutil.copy(debs[-1], deb)
    control = subprocess.run(
        ["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True
    ).stdout.strip()
    data = deb.read_bytes()
    stanza = (
        f"{control}\nFilename: ./{deb.name}\nSize: {len(data)}\n"
        f"SHA256: {hashlib.sha256(data).hexdigest()}\n"
    )
    (root / "Packages").write_text(stanza)
    packages = (root / "Packages").read_bytes()
    (root / "Release").write_text(
        "Origin: covey-test\nLabel: covey-test\nSuite: test\nCodename: test\n"
        "Architectures: amd64 all\nDate: Wed, 02 Dec 2026 00:00:00 UTC\nSHA256:\n"
        f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    sources = root.parent / f"{root.name}.list"
    sources.write_text(f"deb [trusted=yes] http://127.0.0.1:{server.server_address[1]}/ ./\n")
    try:
        yield sources
    finally:
        server.shutdown()
        server.server_close()
