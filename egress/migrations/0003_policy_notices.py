"""PostgreSQL tells the policy stream (egress/stream/) of every change to what the egress
policy is made of, at commit, whatever made it (the admin, the API, a task, a bulk update or
SQL by hand): a trigger on each table ``NOTIFY``s ``covey_policy`` with what changed.

- ``a:ORG:AGENT``: an agent, its templates or its egress tokens;
- ``o:ORG``: an organisation (its base list, its slug: every agent's user name);
- ``b:ORG``: its budgets (who has used one up);
- ``*``: an allowlist template (read again for every organisation), or any of these tables
  emptied at once (``TRUNCATE``). Since 0004_template_notices.py a template says ``*`` only
  when renamed, and ``l:*`` (the shared lists) otherwise.

Notices of one transaction that say the same thing are sent once. SQLite has no notices: the
stream reads a fingerprint of the policy there instead (egress/stream/notices.py).
"""

from django.db import migrations

# Each function notifies for the row before a change (an update or a delete) and after it (an
# insert or an update): a row moved to another organisation changes both. Notices of one
# transaction that say the same thing are sent once.
FUNCTIONS = """
CREATE OR REPLACE FUNCTION covey_policy_agent() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify('covey_policy', 'a:' || OLD.organisation_id || ':' || OLD.id);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('covey_policy', 'a:' || NEW.organisation_id || ':' || NEW.id);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_agent_of(agent_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('covey_policy', 'a:' || coalesce(
        (SELECT organisation_id::text FROM agents_agent WHERE id = agent_id), ''
    ) || ':' || agent_id);
END $$;

CREATE OR REPLACE FUNCTION covey_policy_of_agent() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM covey_policy_agent_of(OLD.agent_id);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM covey_policy_agent_of(NEW.agent_id);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_organisation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify('covey_policy', 'o:' || OLD.id);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('covey_policy', 'o:' || NEW.id);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_budget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify('covey_policy', 'b:' || OLD.organisation_id);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('covey_policy', 'b:' || NEW.organisation_id);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION covey_policy_budget_of(budget_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('covey_policy', 'b:' || coalesce(
        (SELECT organisation_id::text FROM budgets_budget WHERE id = budget_id), ''
    ));
END $$;

CREATE OR REPLACE FUNCTION covey_policy_spend() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM covey_policy_budget_of(OLD.budget_id);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM covey_policy_budget_of(NEW.budget_id);
    END IF;
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
    # Emptied at once (no row triggers fire): everything is read again.
    for table in [*(table for table, _ in TRIGGERS), "budgets_spend"]:
        schema_editor.execute(
            f"CREATE TRIGGER covey_policy_emptied AFTER TRUNCATE ON {table}"
            " FOR EACH STATEMENT EXECUTE FUNCTION covey_policy_everything()"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in [*(table for table, _ in TRIGGERS), "budgets_spend"]:
        for trigger in ("covey_policy", "covey_policy_changed", "covey_policy_emptied"):
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
    for function in (
        "covey_policy_agent()",
        "covey_policy_of_agent()",
        "covey_policy_agent_of(bigint)",
        "covey_policy_organisation()",
        "covey_policy_budget()",
        "covey_policy_budget_of(bigint)",
        "covey_policy_spend()",
        "covey_policy_everything()",
    ):
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {function}")


class Migration(migrations.Migration):
    dependencies = [
        ("egress", "0002_proxy_sessions"),
        ("agents", "0010_agent_credential_grants"),
        ("organisations", "0006_organisation_own_requests"),
        ("templates", "0002_shipped_templates"),
        ("budgets", "0011_used_up_rule"),
    ]

    operations = [migrations.RunPython(create, drop)]
