"""The tests' databases copied from a migrated template (tests/templatedb.py)."""

import shutil

import pytest
from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from tests import templatedb


def test_the_template_is_named_by_the_migrations_of_every_app_covey_installs(tmp_path, monkeypatch):
    config = apps.get_app_config("authtoken")  # Django REST framework's
    copy = tmp_path / "authtoken"
    shutil.copytree(config.path, copy)
    monkeypatch.setattr(config, "path", str(copy))
    before = templatedb.name()
    first = sorted((copy / "migrations").glob("0001_*.py"))[0]
    first.write_text(first.read_text() + "\n# changed\n")
    assert templatedb.name() != before


def test_the_template_is_named_by_covey_s_migrations_and_the_code_they_call(tmp_path, monkeypatch):
    """The shipped templates come from templates/catalogue.py, which no migration holds."""
    shutil.copytree(templatedb.ROOT / "templates", tmp_path / "templates")
    monkeypatch.setattr(templatedb, "ROOT", tmp_path)
    monkeypatch.setattr(apps.get_app_config("templates"), "path", str(tmp_path / "templates"))
    names = {templatedb.name()}
    for changed in ("catalogue.py", "migrations/0001_initial.py"):
        file = tmp_path / "templates" / changed
        file.write_text(file.read_text() + "\n# changed\n")
        names.add(templatedb.name())
    assert len(names) == 3


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
