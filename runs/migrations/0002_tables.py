"""The tables of the models that moved here get this app's names, and their content types
(and so the permissions and admin history that point at them) come along."""

from django.db import migrations

MOVED = ["run", "runevent", "runoutput"]


def move_content_types(apps, schema_editor, source="agents", target="runs"):
    content_types = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        if not content_types.objects.filter(app_label=target, model=model).exists():
            content_types.objects.filter(app_label=source, model=model).update(app_label=target)


def move_them_back(apps, schema_editor):
    move_content_types(apps, schema_editor, source="runs", target="agents")


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
        ("agents", "0006_organisations_and_runs_move_out"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.AlterModelTable(name="run", table=None),
        migrations.AlterModelTable(name="runevent", table=None),
        migrations.AlterModelTable(name="runoutput", table=None),
        migrations.RenameIndex(
            model_name="run",
            new_name="runs_run_agent_i_26707d_idx",
            old_name="agents_run_agent_i_fd2b23_idx",
        ),
        migrations.RunPython(move_content_types, move_them_back),
    ]
