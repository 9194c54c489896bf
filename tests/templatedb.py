"""The tests' PostgreSQL databases copied from one migrated template.

Each of make test's workers needs a database of its own (``test_covey_gw0`` ...). Migrating one
costs about 12 CPU seconds, and the workers all start at once on two cores; copying a migrated
database costs a fraction of a second. The template is named by what migrating runs: every
installed app's migrations, covey's own code (migrations call it: the shipped templates come
from ``templates/catalogue.py``) and Django's version. A change of any of them makes a new one.

A template stays between runs. A run holds a shared lock on its own for as long as it runs
(``pg_advisory_lock_shared``), and drops another only when it can take that one's lock alone:
no run loses the template it copies from to a run of another checkout.
"""

import contextlib
import hashlib
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import django
import psycopg
from django.apps import apps
from psycopg import sql

from tests.processes import ROOT

PREFIX = "covey_tests_template_"
MAKING = 0x636F766579  # pg_advisory_lock's key while a template is made: one maker at a time
NOT_WHAT_MIGRATING_RUNS = {"tests", "bench"}  # covey's packages that no migration imports

_held: list[psycopg.Connection] = []  # the connection holding this process's shared lock
ensured_at: list[datetime] = []  # when ensure() returned: the test database is copied after


def name() -> str:
    """The template of the migrations, covey's code and Django as they are here."""
    digest = hashlib.sha256(django.__version__.encode())
    for config in sorted(apps.get_app_configs(), key=lambda config: config.label):
        if Path(config.path).is_relative_to(ROOT):
            continue  # covey's own: read with its code below
        for file in sorted((Path(config.path) / "migrations").glob("*.py")):
            _add(digest, f"{config.label}/{file.name}", file)
    for package in sorted(ROOT.iterdir()):
        if package.name in NOT_WHAT_MIGRATING_RUNS or not (package / "__init__.py").exists():
            continue
        for file in sorted(package.rglob("*.py")):
            _add(digest, str(file.relative_to(ROOT)), file)
    return PREFIX + digest.hexdigest()[:16]


def _add(digest: "hashlib._Hash", label: str, file: Path) -> None:
    digest.update(f"{label}\0".encode())
    digest.update(file.read_bytes())


def ensure() -> str:
    """The template's name, made first unless it is there (by ``manage.py migrate``, as every
    installation is), and held for this process's life; others of its kind no run holds are
    dropped."""
    template = name()
    connection = psycopg.connect(_url("postgres"), autocommit=True)
    _held.append(connection)  # open until the process ends: its shared lock with it
    connection.execute("SELECT pg_advisory_lock(%s)", [MAKING])
    try:
        connection.execute("SELECT pg_advisory_lock_shared(%s)", [_key(template)])
        found = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [template]
        ).fetchone()
        if found is None:
            _make(connection, template)
        others = connection.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s) AND datname <> %s",
            [PREFIX, template],
        ).fetchall()
        for (other,) in others:
            _drop_unless_held(connection, other)
    finally:
        connection.execute("SELECT pg_advisory_unlock(%s)", [MAKING])
    ensured_at.append(datetime.now(UTC))
    return template


def _drop_unless_held(connection: psycopg.Connection, template: str) -> None:
    """Drop a template no run holds (nor a server refusing it: another role's, say)."""
    key = _key(template)
    if connection.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone() != (True,):
        return
    try:
        with contextlib.suppress(psycopg.Error):  # left as it is: the next run tries again
            connection.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(template)))
    finally:
        connection.execute("SELECT pg_advisory_unlock(%s)", [key])


def _make(connection: psycopg.Connection, template: str) -> None:
    """Migrate a new database, then give it the template's name (no half-made template)."""
    making = f"{template}_making"
    connection.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(making)))
    connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(making)))
    migrated = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "--verbosity", "0"],
        cwd=ROOT, env=os.environ | {"DATABASE_URL": _url(making)}, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    if migrated.returncode != 0:
        raise RuntimeError(f"migrating the tests' template failed:\n{migrated.stderr[-4000:]}")
    connection.execute(
        sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
            sql.Identifier(making), sql.Identifier(template)
        )
    )


def _url(database: str) -> str:
    """DATABASE_URL (the tests' server, as given: its user, host and options) on ``database``."""
    return urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path=f"/{database}"))


def _key(template: str) -> int:
    """A template's advisory lock key: its hash's first 60 bits (a bigint)."""
    return int(template.removeprefix(PREFIX)[:15], 16)
