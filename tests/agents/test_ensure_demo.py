"""`manage.py ensure_demo`: the demo a new installation starts with (make run calls it)."""

import io
import shlex

import pytest
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token

from agents.models import Agent
from organisations.models import Membership, Organisation, Role
from tests.factories import OrganisationFactory, UserFactory


def demo(url: str = "http://127.0.0.1:8000") -> str:
    out = io.StringIO()
    call_command("ensure_demo", url=url, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_a_new_installation_gets_the_demo_agent_and_the_lines_that_run_it():
    admin = UserFactory(username="admin", is_superuser=True, is_staff=True)
    printed = demo("http://127.0.0.1:8123")
    organisation = Organisation.objects.get()
    agent = Agent.objects.get()
    assert (organisation.name, agent.name, agent.workplace, agent.runtime_command) == (
        "Demo", "demo", None, [],
    )  # fmt: skip
    assert sorted(agent.templates.values_list("slug", flat=True)) == ["github", "pypi"]
    assert Membership.objects.get(organisation=organisation, user=admin).role == Role.ADMIN
    token = Token.objects.get(user=admin).key
    lines = [line.strip() for line in printed.splitlines() if line.startswith("  ")]
    export, start, follow = lines
    # What the shell sees: valid command lines, the export apart (README.md changes the agent
    # with it before the first run).
    assert shlex.split(export) == [
        "export", "COVEY_URL=http://127.0.0.1:8123", f"COVEY_TOKEN={token}",
    ]  # fmt: skip
    assert shlex.split(start)[0].startswith("run=$(curl")
    assert f'"agent": {agent.pk}' in start and '"$COVEY_URL/api/v1/runs/"' in start
    assert follow == 'scripts/run-log "$run"'
    assert "http://127.0.0.1:8123/admin/budgets/modelkey/add/" in printed
    # Made once: a later start changes nothing and says nothing (the token was shown once).
    assert demo() == ""
    assert Agent.objects.count() == 1


@pytest.mark.django_db
def test_an_installation_with_organisations_gets_no_demo():
    UserFactory(username="admin", is_superuser=True)
    OrganisationFactory(name="Acme")
    assert demo() == ""
    assert not Agent.objects.exists() and not Token.objects.exists()


@pytest.mark.django_db
def test_the_demo_needs_the_admin_superuser():
    with pytest.raises(CommandError, match="no superuser 'admin'"):
        demo()
    assert not Organisation.objects.exists()
