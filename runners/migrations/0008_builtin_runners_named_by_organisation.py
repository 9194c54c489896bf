"""Built-in runners named after their organisation ("builtin-acme"), as new ones are: every
organisation's was "builtin", so one host's logs and metrics, and people, could not tell them
apart. A name someone gave one by hand is kept, and so is any that would collide."""

import re

from django.db import migrations

MADE = re.compile(r"builtin(-[0-9a-f]{6})?")  # what ensure_builtin_runner named them before


def name_by_organisation(apps, schema_editor):
    Runner = apps.get_model("runners", "Runner")
    for runner in Runner.objects.filter(builtin=True).select_related("organisation"):
        if not MADE.fullmatch(runner.name):
            continue
        name = f"builtin-{runner.organisation.slug}"[:100]
        taken = Runner.objects.filter(organisation_id=runner.organisation_id, name=name)
        if not taken.exclude(pk=runner.pk).exists():
            Runner.objects.filter(pk=runner.pk).update(name=name)


def name_builtin(apps, schema_editor):
    Runner = apps.get_model("runners", "Runner")
    for runner in Runner.objects.filter(builtin=True).select_related("organisation"):
        if runner.name != f"builtin-{runner.organisation.slug}"[:100]:
            continue
        taken = Runner.objects.filter(organisation_id=runner.organisation_id, name="builtin")
        if not taken.exists():
            Runner.objects.filter(pk=runner.pk).update(name="builtin")


class Migration(migrations.Migration):
    dependencies = [
        ("organisations", "0005_api_token"),
        ("runners", "0007_runner_host_readiness_and_proxy_seen"),
    ]

    operations = [migrations.RunPython(name_by_organisation, name_builtin)]
