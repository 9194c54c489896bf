"""A template's notice says what changed in it (egress/migrations/0003_policy_notices.py):

- ``l:*``: its entries, or a template added or removed: only the shared lists are read again
  (an agent that had a removed template is noticed by its own ``a:`` notice, as its row in
  ``agents_agent_templates`` goes first). A stream of before reads it as a notice of no known
  shape, and so reads everything again, as it did: the stream and the migration may be
  upgraded in either order;
- ``*``: its slug, which is how agents name it: everything is read again, as before.

Before, every change of a template was ``*``: the stream read every agent of every
organisation it held again, over a second for one of 10,000 agents, to send one list.
"""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION covey_policy_template() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.slug IS DISTINCT FROM NEW.slug THEN
        PERFORM pg_notify('covey_policy', '*');
    ELSE
        PERFORM pg_notify('covey_policy', 'l:*');
    END IF;
    RETURN NULL;
END $$;
"""


def _point_trigger(schema_editor, function: str) -> None:
    schema_editor.execute("DROP TRIGGER IF EXISTS covey_policy ON templates_allowlisttemplate")
    schema_editor.execute(
        "CREATE TRIGGER covey_policy AFTER INSERT OR UPDATE OR DELETE ON"
        f" templates_allowlisttemplate FOR EACH ROW EXECUTE FUNCTION {function}()"
    )


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FUNCTION)
    _point_trigger(schema_editor, "covey_policy_template")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    _point_trigger(schema_editor, "covey_policy_everything")
    schema_editor.execute("DROP FUNCTION IF EXISTS covey_policy_template()")


class Migration(migrations.Migration):
    dependencies = [("egress", "0003_policy_notices")]

    operations = [migrations.RunPython(create, drop)]
