"""Upgrading an install from before organisations and runs left the agents app: the data, the
content types and the permissions granted on them all come along (PostgreSQL, real migrations
backwards and forwards)."""

import pytest
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

BEFORE = [
    ("agents", "0005_run_output"),
    ("runners", "0004_installation"),
    ("workplaces", "0001_initial"),
    ("contenttypes", "0002_remove_content_type_name"),
    ("auth", "0012_alter_user_first_name_max_length"),
    ("organisations", None),
    ("runs", None),
]


def migrate(targets):
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    return executor.loader.project_state([t for t in targets if t[1] is not None]).apps


def latest():
    return MigrationExecutor(connection).loader.graph.leaf_nodes()


def test_an_install_from_before_the_move_keeps_its_data_and_permissions():
    try:
        old = migrate(BEFORE)
        organisation = old.get_model("agents", "Organisation").objects.create(
            name="Acme", slug="acme", base_allowlist=["api.anthropic.com"]
        )
        user = old.get_model("auth", "User").objects.create(username="platform")
        old.get_model("agents", "Membership").objects.create(
            organisation=organisation, user=user, role="admin"
        )
        agent = old.get_model("agents", "Agent").objects.create(
            organisation=organisation, name="Builder", slug="builder", allowlist=[]
        )
        version = old.get_model("agents", "AgentVersion").objects.create(
            agent=agent, number=1, config={}
        )
        run = old.get_model("agents", "Run").objects.create(
            agent=agent, agent_version=version, task="build", timeout=60, status="succeeded"
        )
        old.get_model("agents", "RunEvent").objects.create(run=run, status="succeeded")
        # As an old install has them (this database's were moved back by the migrations).
        content_type, _ = old.get_model("contenttypes", "ContentType").objects.get_or_create(
            app_label="agents", model="organisation"
        )
        permission, _ = old.get_model("auth", "Permission").objects.get_or_create(
            content_type=content_type,
            codename="add_organisation",
            defaults={"name": "Can add organisation"},
        )
        user.user_permissions.add(permission)
        # And, as after a migrate that stopped halfway, the new app's own content type with
        # its permission already there (post_migrate made them): the grant must move to it.
        twin_type, _ = old.get_model("contenttypes", "ContentType").objects.get_or_create(
            app_label="organisations", model="organisation"
        )
        old.get_model("auth", "Permission").objects.get_or_create(
            content_type=twin_type,
            codename="add_organisation",
            defaults={"name": "Can add organisation"},
        )

        migrate(latest())

        from organisations.models import Membership, Organisation
        from runs.models import Run

        moved = Organisation.objects.get(slug="acme")
        assert moved.base_allowlist == ["api.anthropic.com"]
        assert Membership.objects.get(organisation=moved).role == "admin"
        assert list(moved.agents.values_list("slug", flat=True)) == ["builder"]
        kept = Run.objects.get(pk=run.pk)
        assert (kept.task, kept.agent.slug, kept.events.get().status) == (
            "build",
            "builder",
            "succeeded",
        )
        assert (
            get_user_model()
            .objects.get(username="platform")
            .has_perm("organisations.add_organisation")
        )
        old_types_left = ContentType.objects.filter(
            app_label="agents", model="organisation"
        ).exists()
        assert not old_types_left
        with connection.cursor() as cursor:
            tables = connection.introspection.table_names(cursor)
        assert {"organisations_organisation", "runs_run", "runs_runevent"} <= set(tables)
        assert not {"agents_organisation", "agents_run"} & set(tables)
    finally:
        migrate(latest())


def test_a_workplaces_recorded_history_becomes_its_versions():
    """Workplaces were recorded by django-simple-history; the upgrade makes one version of
    each recorded state that differs from the one before, with who made it and when."""
    from datetime import UTC, datetime

    try:
        old = migrate(
            [
                ("workplaces", "0002_organisations_move"),
                ("runs", "0003_run_home_changes"),
                ("organisations", "0002_tables"),
            ]
        )
        organisation = old.get_model("organisations", "Organisation").objects.create(
            name="Acme", slug="acme", base_allowlist=[]
        )
        user = old.get_model("auth", "User").objects.create(username="platform")
        workplace = old.get_model("workplaces", "Workplace").objects.create(
            organisation=organisation, name="dev", image="covey-base:trixie"
        )
        history = old.get_model("workplaces", "HistoricalWorkplace")
        for n, (image, description) in enumerate(
            [("covey-base:bookworm", ""), ("covey-base:bookworm", ""), ("covey-base:trixie", "")]
        ):
            history.objects.create(
                id=workplace.pk, organisation=organisation, name="dev", image=image,
                description=description, created_at=workplace.created_at,
                updated_at=workplace.updated_at, history_type="+" if n == 0 else "~",
                history_date=datetime(2026, 1, 1 + n, tzinfo=UTC), history_user=user,
            )  # fmt: skip

        migrate(latest())

        from workplaces.models import Workplace

        kept = Workplace.objects.get(pk=workplace.pk)
        versions = list(kept.versions.order_by("number"))
        assert kept.version == 2
        assert [v.config["image"] for v in versions] == ["covey-base:bookworm", "covey-base:trixie"]
        assert versions[1].changes == {"image": ["covey-base:bookworm", "covey-base:trixie"]}
        assert [v.created_by.username for v in versions] == ["platform", "platform"]
        assert versions[1].created_at == datetime(2026, 1, 3, tzinfo=UTC)
        assert versions[0].config["packages"] == {} and versions[0].config["services"] == []
    finally:
        migrate(latest())
