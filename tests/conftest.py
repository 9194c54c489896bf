"""Shared fixtures: the personas every API test uses, and the service markers.

Who may see what:
- ``acme`` has ``alice`` (admin: changes everything in acme), ``april`` (approver: reads, decides
  requests) and ``vera`` (viewer: reads only).
- ``globex`` has ``gary`` (admin). Gary must see nothing of acme, and acme's people nothing of
  globex: another organisation's object is simply 404.
- ``root`` is a superuser: the platform team, sees and changes everything.
- ``nobody`` is signed in but belongs to no organisation: sees nothing.
"""

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from functools import cache
from importlib import import_module
from urllib.parse import urlparse

import pytest
from django.conf import settings
from pytest_django.plugin import blocking_manager_key, validate_django_db
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from covey import var
from organisations.models import Membership, Role
from tests import templatedb, workers
from tests.factories import OrganisationFactory, UserFactory

pytest_plugins = ["tests.suites"]  # the reliability and security suites, counted

IN_CI = os.environ.get("CI") == "true"

workers.apply()  # this test process's own Redis database, before anything connects

# Test users' passwords hashed in microseconds, not a PBKDF2 of 100 ms each (the factories
# make thousands). Processes the tests start keep the real hashers: tests.factories.server_user.
QUICK_HASHER = "django.contrib.auth.hashers.MD5PasswordHasher"
settings.PASSWORD_HASHERS = [QUICK_HASHER, *settings.PASSWORD_HASHERS]

HEAVY = ("docker", "e2e")  # markers of the tests that take seconds to minutes each


NOT_THE_TESTS = settings.DATABASES["default"]["NAME"]  # before pytest-django puts the tests' in
# What the data migrations ship (in migration order): a transactional test's teardown empties
# every table, and the next test of its worker must find them as a new installation has them.
SHIPPED = (
    ("templates.migrations.0002_shipped_templates", "install"),
    ("budgets.migrations.0002_shipped_prices", "ship"),
    ("budgets.migrations.0009_openai_prices", "ship"),
    ("budgets.migrations.0010_runtime_models", "ship"),
)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    request: pytest.FixtureRequest,
    django_db_modify_db_settings_parallel_suffix: None,
) -> None:
    """On PostgreSQL the tests' databases are copies of one migrated template
    (tests/templatedb.py): the first process to need one makes it, the others wait for it."""
    database = settings.DATABASES["default"]
    if database["ENGINE"] != "django.db.backends.postgresql":
        return
    if request.config.getvalue("nomigrations"):
        return  # tables made from the models: a migrated template's would be in their way
    database.setdefault("TEST", {})["TEMPLATE"] = templatedb.ensure()


def _flush_by_delete() -> None:
    """A transactional test's teardown empties every table on PostgreSQL with ``DELETE``, not
    Django's one ``TRUNCATE`` of them all: 0.01 s against 0.5 s here, where every table holds a
    few rows (``TRUNCATE`` makes each table's files anew), for 250 tests. The same rows go, the
    sequences stay as they do with ``TRUNCATE`` (without ``reset_sequences``), and every foreign
    key Django makes is checked at commit (``DEFERRABLE INITIALLY DEFERRED``), when the tables
    are all empty. Row triggers fire (the policy's notices) where ``TRUNCATE`` fires its own.
    tests/test_flush.py holds that it leaves nothing."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if not tables or reset_sequences or allow_cascade:
            return truncate(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return [
            "SET CONSTRAINTS ALL DEFERRED",
            *(f"DELETE FROM {self.quote_name(table)}" for table in sorted(tables)),  # noqa: S608
        ]

    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign]


_flush_by_delete()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a transactional test's flush, the shipped rows again, so that every test finds
    them whatever ran before it on its worker (the tests may then be handed out in any order:
    make test steals work between workers)."""
    yield
    # The last test's teardown has ended the session too (the test database is gone): none.
    if nextitem is None or not _flushes(item):
        return
    from django.apps import apps
    from django.db import connection

    with item.config.stash[blocking_manager_key].unblock():
        if connection.settings_dict["NAME"] == NOT_THE_TESTS:
            return  # never the database the tests were not given
        for module, name in SHIPPED:
            getattr(import_module(module), name)(apps, None)


def _flushes(item: pytest.Item) -> bool:
    """A test whose teardown empties the tables (pytest-django's transactional ones)."""
    marker = item.get_closest_marker("django_db")
    fixtures = set(getattr(item, "fixturenames", ()))
    if marker is not None:
        transaction, reset_sequences, *_ = validate_django_db(marker)
        if transaction or reset_sequences:
            return True
    return bool({"transactional_db", "live_server"} & fixtures)


def _in_a_transaction(item: pytest.Item) -> bool:
    """A test pytest-django runs inside a transaction (rolled back after): it must run before
    any transactional one, which empties the tables (the data migrations' rows too)."""
    marker = item.get_closest_marker("django_db")
    fixtures = getattr(item, "fixturenames", ())
    if marker is not None:
        transaction, reset_sequences, *_ = validate_django_db(marker)
        if transaction or reset_sequences:
            return False
    elif "db" not in fixtures:
        return False
    return not {"transactional_db", "live_server"} & set(fixtures)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test in a browser or against a live server is marked e2e; then the heavy tests go
    first (after pytest-django's order, which this keeps: those in a transaction before the
    others), so that no worker is left with a long one at the end while the others are idle."""
    for item in items:
        if {"browser", "live_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    items.sort(
        key=lambda item: (
            not _in_a_transaction(item),
            not any(item.get_closest_marker(name) for name in HEAVY),
        )
    )


@cache
def _service_problem(name: str) -> str | None:
    """Why a service the tests need is unavailable, or None when it answers."""
    if name == "postgres":
        url = urlparse(os.environ.get("DATABASE_URL", ""))
        if url.scheme not in ("postgres", "postgresql"):
            return "DATABASE_URL does not point at PostgreSQL"
        return _tcp_problem(url.hostname or "127.0.0.1", url.port or 5432)
    if name == "redis":
        url = urlparse(settings.CELERY_BROKER_URL)
        if url.scheme != "redis":
            return "CELERY_BROKER_URL does not point at Redis"
        return _tcp_problem(url.hostname or "127.0.0.1", url.port or 6379)
    if name == "docker":
        path = "/var/run/docker.sock"
        return None if os.path.exists(path) else f"no Docker engine socket at {path}"
    raise ValueError(name)


def _tcp_problem(host: str, port: int) -> str | None:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc}"
    return None


@pytest.fixture(autouse=True)
def _required_services(request: pytest.FixtureRequest) -> None:
    """A test marked postgres/redis/docker skips without it, but fails under CI=true."""
    for name in ("postgres", "redis", "docker"):
        if request.node.get_closest_marker(name) and (problem := _service_problem(name)):
            message = f"{name} is required: {problem}"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)


@pytest.fixture(autouse=True)
def _firewall_as_covey_left_it(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of hard isolation reads the host's firewall as covey left it: no other test
    process makes a hole meanwhile (tests/workers.py)."""
    if "firewall" not in request.fixturenames:
        yield
        return
    with workers.FIREWALL.shared():
        yield


@pytest.fixture(autouse=True, scope="session")
def _own_var_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """What the control plane writes at run time (built-in runner identities, run logs) goes
    to a directory of the test session, never to the project's var/."""
    directory = var.prepare(tmp_path_factory.mktemp("var"))
    settings.VAR_DIR = directory
    settings.MEDIA_ROOT = directory / "media"
    settings.STATIC_ROOT = directory / var.STATIC  # made (empty): WhiteNoise wants one
    if not os.environ.get("DJANGO_SECRET_KEY"):  # a fresh clone has made none (make run does)
        settings.SECRET_KEY = var.secret_key(directory)
    if not os.environ.get("COVEY_ENCRYPTION_KEYS"):
        settings.COVEY_ENCRYPTION_KEYS = [var.encryption_key(directory)]


@pytest.fixture
def acme(db):
    return OrganisationFactory(name="Acme")


@pytest.fixture
def globex(db):
    return OrganisationFactory(name="Globex")


def _member(organisation, username, role):
    user = UserFactory(username=username)
    Membership.objects.create(organisation=organisation, user=user, role=role)
    return user


@pytest.fixture
def alice(acme):
    return _member(acme, "alice", Role.ADMIN)


@pytest.fixture
def april(acme):
    return _member(acme, "april", Role.APPROVER)


@pytest.fixture
def vera(acme):
    return _member(acme, "vera", Role.VIEWER)


@pytest.fixture
def gary(globex):
    return _member(globex, "gary", Role.ADMIN)


@pytest.fixture
def root(db):
    return UserFactory(username="root", is_superuser=True, is_staff=True)


@pytest.fixture
def nobody(db):
    return UserFactory(username="nobody")


@pytest.fixture
def api() -> Callable[..., APIClient]:
    """An API client authenticated the way automation is: ``Authorization: Token <key>``."""

    def client_for(user) -> APIClient:
        client = APIClient()
        token, _ = Token.objects.get_or_create(user=user)
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        return client

    return client_for


@pytest.fixture
def operator_client(client, root):
    """The Django test client, signed in to the admin as the superuser."""
    client.force_login(root)
    return client


BASE_IMAGE = "covey-base:trixie"  # make base-image
WORKPLACE_IMAGE = "covey-workplace:latest"


def _image_exists(image: str) -> bool:
    try:
        inspect = subprocess.run(
            ["docker", "image", "inspect", image], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return inspect.returncode == 0


@pytest.fixture(scope="session")
def base_image() -> str:
    """The locally built base image; skips without it, but fails under CI=true."""
    if _image_exists(BASE_IMAGE):
        return BASE_IMAGE
    message = f"{BASE_IMAGE} is not on this host: run `make base-image`"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def workplace_image() -> str:
    """The default workplace image (the Claude runtime); skips without it, but fails under
    CI=true."""
    if _image_exists(WORKPLACE_IMAGE):
        return WORKPLACE_IMAGE
    message = f"{WORKPLACE_IMAGE} is not on this host: run `make workplace-image`"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def orders(monkeypatch) -> list[tuple[str, int, str]]:
    """The orders that would go to runners' queues (kind, runner id, run, probe or home
    operation id); no broker needed."""
    from runners import dispatch

    sent: list[tuple[str, int, str]] = []
    for kind in ("launch", "cancel", "probe", "home"):
        monkeypatch.setattr(
            dispatch, f"send_{kind}", lambda r, item, kind=kind: sent.append((kind, r.pk, item))
        )
    return sent
