"""Agent and organisation services: versioning and the effective allowlist."""

import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction

from agents import services
from agents.models import Agent, AgentVersion
from allowlists.entries import Entry
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory, UserFactory, WorkplaceFactory

pytestmark = pytest.mark.django_db


def test_an_agent_starts_at_version_one_with_its_whole_configuration(acme):
    workplace = WorkplaceFactory(organisation=acme, image="covey/base:1")
    agent = AgentFactory(
        organisation=acme,
        name="Builder",
        templates=AllowlistTemplate.objects.filter(slug__in=["npm", "go"]),
        allowlist=["b.example", "a.example:80"],
        required_labels=["eu"],
        workplace=workplace,
    )
    (version,) = agent.versions.all()
    assert agent.version == version.number == 1
    assert version.config == {
        "name": "Builder",
        "slug": "builder",
        "enabled": True,
        "templates": ["go", "npm"],
        "allowlist": ["a.example:80", "b.example"],
        "credential_grants": [],
        "required_labels": ["eu"],
        "workplace": {"id": workplace.pk, "name": workplace.name},
        "sandbox": {
            "command": [],
            "cpus": 1.0,
            "memory_mb": 2048,
            "pids": 512,
            "timeout": 3600,
            "home_quota_mb": None,
        },
    }


def test_versions_record_who_changed_what(acme):
    alice = UserFactory(username="alice")
    agent = AgentFactory(organisation=acme)
    services.update_agent(agent, by=alice, enabled=False, allowlist=["x.example"])
    assert agent.version == 2
    latest = agent.versions.get(number=2)
    assert latest.created_by == alice
    assert latest.changes == {"allowlist": [[], ["x.example"]], "enabled": [True, False]}


def test_unknown_fields_are_a_programming_error(acme):
    agent = AgentFactory(organisation=acme)
    with pytest.raises(TypeError, match="version"):
        services.update_agent(agent, version=7)


def test_a_failed_change_writes_nothing(acme, globex):
    agent = AgentFactory(organisation=acme)
    theirs = WorkplaceFactory(organisation=globex)
    with pytest.raises(ValidationError):
        services.update_agent(agent, enabled=False, workplace=theirs)
    agent.refresh_from_db()
    assert (agent.enabled, agent.workplace, agent.version) == (True, None, 1)
    assert agent.versions.count() == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_changes_get_consecutive_version_numbers(acme):
    agent = AgentFactory(organisation=acme)
    errors = []

    def change(number):
        try:
            services.update_agent(Agent.objects.get(pk=agent.pk), allowlist=[f"h{number}.example"])
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=change, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    agent.refresh_from_db()
    assert agent.version == 9
    numbers = sorted(AgentVersion.objects.filter(agent=agent).values_list("number", flat=True))
    assert numbers == list(range(1, 10))


def test_the_effective_allowlist_says_where_each_entry_comes_from(acme):
    acme.base_allowlist = ["api.anthropic.com", "shared.example"]
    acme.save()
    AllowlistTemplate.objects.filter(slug="pypi").update(entries=["shared.example", "p.example"])
    agent = AgentFactory(
        organisation=acme,
        templates=AllowlistTemplate.objects.filter(slug="pypi"),
        allowlist=["own.example:8443", "shared.example"],
    )
    assert services.effective_allowlist(agent) == {
        Entry("api.anthropic.com"): ["base"],
        Entry("own.example", 8443): ["agent"],
        Entry("p.example"): ["template:pypi"],
        Entry("shared.example"): ["base", "template:pypi", "agent"],
    }


def test_an_invalid_entry_never_reaches_the_database(acme):
    acme.base_allowlist = ["fine.example", "127.0.0.1"]
    with pytest.raises(ValueError, match="IP address"), transaction.atomic():
        acme.save()
    acme.refresh_from_db()
    assert acme.base_allowlist == ["api.anthropic.com"]
