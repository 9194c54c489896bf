"""The tables of the models that moved here get this app's names, and their content types
(and so the permissions and admin history that point at them) come along."""

from django.db import migrations

from covey.moved_models import move_content_types


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
        ("agents", "0006_organisations_and_runs_move_out"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("admin", "0003_logentry_add_action_flag_choices"),
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
        move_content_types("agents", "runs", ["run", "runevent", "runoutput"]),
    ]
