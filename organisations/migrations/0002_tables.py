"""The tables of the models that moved here get this app's names, and their content types
(and so the permissions and admin history that point at them) come along."""

from django.db import migrations

MOVED = ["organisation", "membership", "historicalorganisation", "historicalmembership"]


def move_content_types(apps, schema_editor, source="agents", target="organisations"):
    content_types = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        if not content_types.objects.filter(app_label=target, model=model).exists():
            content_types.objects.filter(app_label=source, model=model).update(app_label=target)


def move_them_back(apps, schema_editor):
    move_content_types(apps, schema_editor, source="organisations", target="agents")


class Migration(migrations.Migration):
    dependencies = [
        ("organisations", "0001_initial"),
        ("agents", "0006_organisations_and_runs_move_out"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.AlterModelTable(name="organisation", table=None),
        migrations.AlterModelTable(name="membership", table=None),
        migrations.AlterModelTable(name="historicalorganisation", table=None),
        migrations.AlterModelTable(name="historicalmembership", table=None),
        migrations.RunPython(move_content_types, move_them_back),
    ]
