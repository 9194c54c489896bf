"""The tests' databases copied from a migrated template (tests/templatedb.py)."""

import shutil

import pytest
from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from tests import templatedb


def test_the_template_is_named_by_every_migration(tmp_path, monkeypatch):
    before = templatedb.name()
    config = apps.get_app_config("egress")
    copy = tmp_path / "egress"
    shutil.copytree(config.path, copy)
    monkeypatch.setattr(config, "path", str(copy))
    assert templatedb.name() == before
    first = sorted((copy / "migrations").glob("0001_*.py"))[0]
    first.write_text(first.read_text() + "\n# changed\n")
    assert templatedb.name() != before


def test_the_template_is_named_by_the_code_migrations_call_too(tmp_path, monkeypatch):
    """The shipped templates come from templates/catalogue.py, which no migration holds."""
    shutil.copytree(templatedb.ROOT / "templates", tmp_path / "templates")
    monkeypatch.setattr(templatedb, "ROOT", tmp_path)
    before = templatedb.name()
    catalogue = tmp_path / "templates" / "catalogue.py"
    catalogue.write_text(catalogue.read_text() + "\n# changed\n")
    assert templatedb.name() != before


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_tests_database_is_a_copy_of_the_migrated_template():
    """Copied, not migrated: every migration it holds was applied before the copy was made."""
    assert settings.DATABASES["default"]["TEST"]["TEMPLATE"] == templatedb.name()
    loader = MigrationLoader(connection)
    assert set(loader.graph.leaf_nodes()) <= loader.applied_migrations.keys()
    with connection.cursor() as cursor:
        cursor.execute("SELECT max(applied) FROM django_migrations")
        (newest,) = cursor.fetchone()
    assert newest < templatedb.ensured_at[0]
