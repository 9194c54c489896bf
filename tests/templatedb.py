"""The tests' PostgreSQL databases copied from one migrated template.

Each of make test's workers needs a database of its own (``test_covey_gw0`` ...). Migrating one
costs about 12 CPU seconds, and the workers all start at once on two cores; copying a migrated
database costs a fraction of a second. The template is named by the migrations it was made
from (every installed app's), so that a change of any of them makes a new one; it stays between
runs, and the ones made from other migrations are dropped.
"""

import contextlib
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import psycopg
from django.apps import apps
from psycopg import sql

from tests.processes import ROOT

PREFIX = "covey_tests_template_"
LOCK = 0x636F766579  # pg_advisory_lock's key: one maker at a time, whatever the checkout


def name() -> str:
    """The template of the migrations as they are in this checkout and its packages."""
    digest = hashlib.sha256()
    for config in sorted(apps.get_app_configs(), key=lambda config: config.label):
        for file in sorted((Path(config.path) / "migrations").glob("*.py")):
            digest.update(f"{config.label}/{file.name}\0".encode())
            digest.update(file.read_bytes())
    return PREFIX + digest.hexdigest()[:16]


def ensure(database: dict) -> str:
    """The template's name, made first unless it is there (migrated by ``manage.py migrate``,
    as every installation is); the others of its kind dropped."""
    template = name()
    server = {
        "host": database["HOST"],
        "port": database["PORT"] or 5432,
        "user": database["USER"],
        "password": database["PASSWORD"] or None,
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as connection:
        connection.execute("SELECT pg_advisory_lock(%s)", [LOCK])
        found = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [template]
        ).fetchone()
        if found is None:
            _make(connection, template, server)
        others = connection.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s) AND datname <> %s",
            [PREFIX, template],
        ).fetchall()
        for (other,) in others:  # one in use (a run of another checkout) is left to its run
            with contextlib.suppress(psycopg.errors.ObjectInUse):
                connection.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(other)))
        connection.execute("SELECT pg_advisory_unlock(%s)", [LOCK])
    return template


def _make(connection: psycopg.Connection, template: str, server: dict) -> None:
    """Migrate a new database, then give it the template's name (no half-made template)."""
    building = f"{template}_making"
    connection.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(building)))
    connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(building)))
    password = f":{quote(server['password'], safe='')}" if server["password"] else ""
    url = f"postgres://{server['user']}{password}@{server['host']}:{server['port']}/{building}"
    migrated = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "--verbosity", "0"],
        cwd=ROOT, env=os.environ | {"DATABASE_URL": url}, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    if migrated.returncode != 0:
        raise RuntimeError(f"migrating the tests' template failed:\n{migrated.stderr[-4000:]}")
    connection.execute(
        sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
            sql.Identifier(building), sql.Identifier(template)
        )
    )
