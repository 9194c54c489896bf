"""Test processes side by side (``make test`` runs pytest-xdist workers): what each takes of
this machine so that none meets another's.

- PostgreSQL: pytest-django gives each worker a database of its own (``test_covey_gw0`` ...),
  a copy of one migrated template (tests/templatedb.py).
- Redis: each process its own database number (``broker_url``), so a Celery worker a test
  starts takes only that test process's orders.
- Loopback: each process a block of addresses of its own, 127.0.<block>.0/24
  (``loopback_block``), held by a lock file for as long as it runs, so two processes never
  bind the same address and port (the plain-HTTP upstreams all want port 80).
- The host's firewall: tests that read what covey added run under a shared ``FIREWALL`` lock;
  tests that change it (a hole made on purpose) under the exclusive one.

Docker objects need nothing here: each test labels and names its own.
"""

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from urllib.parse import urlparse, urlunparse

# The lock files, one place for every test process; the kernel lets go of a lock when its
# process ends.
LOCKS = Path(tempfile.gettempdir())
REDIS_DATABASES = 16  # Redis's default `databases`


def index() -> int:
    """This process's worker number: 0 for gw0 and for a run without workers."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name.removeprefix("gw"))


def parallel() -> bool:
    """Whether this process is one of several pytest-xdist workers."""
    return "PYTEST_XDIST_WORKER" in os.environ


def broker_url(url: str) -> str:
    """``url`` (a Redis URL) on this process's own database, one past the given number for each
    worker; ValueError when there are more workers than Redis has databases."""
    parsed = urlparse(url)
    if parsed.scheme != "redis" or not parallel():
        return url
    base = int(parsed.path.strip("/") or 0)
    number = base + 1 + index()
    if number >= REDIS_DATABASES:
        raise ValueError(
            f"worker {index()} would need Redis database {number}; Redis has "
            f"{REDIS_DATABASES}: run fewer workers (TEST_WORKERS)"
        )
    return urlunparse(parsed._replace(path=f"/{number}"))


_held: list[int] = []  # the open lock files of this process, kept for its lifetime


@cache
def loopback_block() -> int:
    """The third byte of this process's loopback addresses: 0 without workers (the addresses
    the tests always used), else the first of 1..254 no other running process holds."""
    if not parallel():
        return 0
    for block in range(1, 255):
        descriptor = os.open(LOCKS / f"covey-test-loopback-{block}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue
        _held.append(descriptor)
        return block
    raise RuntimeError("every loopback block 127.0.1-254.0/24 is held by another test process")


def apply() -> None:
    """Put this process on its own Redis database: the settings, the environment its
    subprocesses inherit, and the Celery app if it is configured already."""
    url = os.environ.get("CELERY_BROKER_URL", "")
    own = broker_url(url)
    if own == url:
        return
    os.environ["CELERY_BROKER_URL"] = own
    from django.conf import settings

    if settings.configured:
        settings.CELERY_BROKER_URL = own
    from covey.celery import app

    app.conf.broker_url = own


class MachineLock:
    """A lock over something every test process shares (the host's firewall): shared by those
    that only read it, exclusive for one that changes it; the same process may take it again."""

    def __init__(self, name: str) -> None:
        self.path = LOCKS / f"covey-test-{name}.lock"
        self._descriptor: int | None = None
        self._holders: list[int] = []  # the modes held, innermost last

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._holding(fcntl.LOCK_SH):
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._holding(fcntl.LOCK_EX):
            yield

    @contextmanager
    def _holding(self, mode: int) -> Iterator[None]:
        if self._descriptor is None:
            self._descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT)
        before = max(self._holders, default=None)  # LOCK_EX (2) > LOCK_SH (1)
        if before is None or mode > before:
            fcntl.flock(self._descriptor, mode)
        self._holders.append(mode)
        try:
            yield
        finally:
            self._holders.pop()
            after = max(self._holders, default=None)
            if after is None:
                fcntl.flock(self._descriptor, fcntl.LOCK_UN)
            elif after < mode:
                fcntl.flock(self._descriptor, after)


FIREWALL = MachineLock("firewall")
