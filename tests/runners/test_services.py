"""Built-in runners are named after their organisation, so one host's logs and metrics, and
people, tell them apart; those named before are renamed by a migration."""

from importlib import import_module

import pytest
from django.apps import apps

from runners.models import Runner
from runners.services import ensure_builtin_runner
from tests.factories import OrganisationFactory, online_runner

pytestmark = pytest.mark.django_db

renaming = import_module("runners.migrations.0008_builtin_runners_named_by_organisation")


def builtin(organisation) -> Runner:
    return Runner.objects.get(organisation=organisation, builtin=True)


def test_two_organisations_built_in_runners_have_names_of_their_own(acme, globex):
    assert (builtin(acme).name, builtin(globex).name) == ("builtin-acme", "builtin-globex")


def test_a_name_taken_by_another_runner_gets_a_suffix(settings):
    settings.COVEY_BUILTIN_RUNNER = False
    initech = OrganisationFactory(name="Initech")
    online_runner(initech, "builtin-initech")
    settings.COVEY_BUILTIN_RUNNER = True
    made = ensure_builtin_runner(initech)
    assert made is not None and made.name.startswith("builtin-initech-") and len(made.name) == 22


def test_the_migration_renames_the_built_in_runners_named_before(acme, globex):
    initech = OrganisationFactory(name="Initech")
    Runner.objects.filter(pk=builtin(acme).pk).update(name="builtin")
    Runner.objects.filter(pk=builtin(globex).pk).update(name="builtin-0a1b2c")
    Runner.objects.filter(pk=builtin(initech).pk).update(name="main")  # named by hand: kept
    renaming.name_by_organisation(apps, None)
    assert builtin(acme).name == "builtin-acme"
    assert builtin(globex).name == "builtin-globex"
    assert builtin(initech).name == "main"

    renaming.name_builtin(apps, None)  # and back
    assert (builtin(acme).name, builtin(globex).name) == ("builtin", "builtin")


def test_the_migration_leaves_a_name_another_runner_of_its_organisation_has(acme):
    Runner.objects.filter(pk=builtin(acme).pk).update(name="builtin")
    online_runner(acme, "builtin-acme")
    renaming.name_by_organisation(apps, None)
    assert builtin(acme).name == "builtin"
