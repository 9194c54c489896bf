"""PostgreSQL tells the policy stream (egress/stream/) of every change to what the egress
policy is made of, at commit, whatever made it (the admin, the API, a task, a bulk update or
SQL by hand): a trigger on each table ``NOTIFY``s ``covey_policy`` with what changed.

- ``a:ORG:AGENT``: an agent, its templates or its egress tokens;
- ``o:ORG``: an organisation (its base list, its slug: every agent's user name);
- ``b:ORG``: its budgets (who has used one up);
- ``*``: an allowlist template (read again for every organisation).

Notices of one transaction that say the same thing are sent once. SQLite has no notices: the
stream reads a fingerprint of the policy there instead (egress/stream/notices.py).
"""

from django.db import migrations

FUNCTIONS = """
CREATE OR REPLACE FUNCTION covey_policy_agent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE row_ RECORD;
BEGIN
    IF TG_OP = 'DELETE' THEN row_ := OLD; ELSE row_ := NEW; END IF;
    PERFORM pg_notify('covey_policy', 'a:' || row_.organisation_id || ':' || row_.id);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_of_agent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE row_ RECORD;
BEGIN
    IF TG_OP = 'DELETE' THEN row_ := OLD; ELSE row_ := NEW; END IF;
    PERFORM pg_notify('covey_policy', 'a:' || coalesce(
        (SELECT organisation_id::text FROM agents_agent WHERE id = row_.agent_id), ''
    ) || ':' || row_.agent_id);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_organisation() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE row_ RECORD;
BEGIN
    IF TG_OP = 'DELETE' THEN row_ := OLD; ELSE row_ := NEW; END IF;
    PERFORM pg_notify('covey_policy', 'o:' || row_.id);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_budget() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE row_ RECORD;
BEGIN
    IF TG_OP = 'DELETE' THEN row_ := OLD; ELSE row_ := NEW; END IF;
    PERFORM pg_notify('covey_policy', 'b:' || row_.organisation_id);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_spend() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE row_ RECORD;
BEGIN
    IF TG_OP = 'DELETE' THEN row_ := OLD; ELSE row_ := NEW; END IF;
    PERFORM pg_notify('covey_policy', 'b:' || coalesce(
        (SELECT organisation_id::text FROM budgets_budget WHERE id = row_.budget_id), ''
    ));
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_everything() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('covey_policy', '*');
    RETURN NULL;
END $$;
"""

# (table, function): a row trigger after every insert, update and delete. A spend's update
# counts only when it changes who has used a budget up (every model call settles into a spend;
# only that matters to the policy).
TRIGGERS = [
    ("agents_agent", "covey_policy_agent"),
    ("agents_agent_templates", "covey_policy_of_agent"),
    ("egress_egresstoken", "covey_policy_of_agent"),
    ("organisations_organisation", "covey_policy_organisation"),
    ("budgets_budget", "covey_policy_budget"),
    ("templates_allowlisttemplate", "covey_policy_everything"),
]
SPEND_CHANGES = (
    "OLD.exhausted_at IS DISTINCT FROM NEW.exhausted_at OR OLD.period IS DISTINCT FROM"
    " NEW.period OR OLD.starts_at IS DISTINCT FROM NEW.starts_at OR OLD.ends_at IS DISTINCT"
    " FROM NEW.ends_at"
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FUNCTIONS)
    for table, function in TRIGGERS:
        schema_editor.execute(
            f"CREATE TRIGGER covey_policy AFTER INSERT OR UPDATE OR DELETE ON {table}"
            f" FOR EACH ROW EXECUTE FUNCTION {function}()"
        )
    schema_editor.execute(
        "CREATE TRIGGER covey_policy AFTER INSERT OR DELETE ON budgets_spend"
        " FOR EACH ROW EXECUTE FUNCTION covey_policy_spend()"
    )
    schema_editor.execute(
        f"CREATE TRIGGER covey_policy_changed AFTER UPDATE ON budgets_spend FOR EACH ROW"
        f" WHEN ({SPEND_CHANGES}) EXECUTE FUNCTION covey_policy_spend()"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, _ in TRIGGERS:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS covey_policy ON {table}")
    schema_editor.execute("DROP TRIGGER IF EXISTS covey_policy ON budgets_spend")
    schema_editor.execute("DROP TRIGGER IF EXISTS covey_policy_changed ON budgets_spend")
    for function in (
        "covey_policy_agent",
        "covey_policy_of_agent",
        "covey_policy_organisation",
        "covey_policy_budget",
        "covey_policy_spend",
        "covey_policy_everything",
    ):
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {function}()")


class Migration(migrations.Migration):
    dependencies = [
        ("egress", "0002_proxy_sessions"),
        ("agents", "0010_agent_credential_grants"),
        ("organisations", "0006_organisation_own_requests"),
        ("templates", "0002_shipped_templates"),
        ("budgets", "0011_used_up_rule"),
    ]

    operations = [migrations.RunPython(create, drop)]
