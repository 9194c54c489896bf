"""Records in the admin (organisations/readonly.py): versions, logs, audits, the ledger and
requests are read, and nobody adds, changes or deletes them by hand, not even an admin of
their organisation or the platform team."""

import pytest
from django.contrib import admin
from django.test import RequestFactory

from agents import services
from agents.models import AgentVersion
from approvals.models import Request
from budgets.models import Charge
from egress.models import Decision, ProxySession
from homes.models import HomeChange
from organisations.readonly import ReadOnlyAdmin
from workplaces.models import WorkplaceVersion

RECORDS = [AgentVersion, WorkplaceVersion, HomeChange, Decision, ProxySession, Charge, Request]


def asked_by(user):
    request = RequestFactory().get("/admin/")
    request.user = user
    return request


@pytest.mark.django_db
@pytest.mark.parametrize("model", RECORDS, ids=lambda model: model.__name__)
def test_an_organisation_admin_and_the_platform_team_may_not_add_change_or_delete_records(
    model, alice, root
):
    page = admin.site._registry[model]
    assert isinstance(page, ReadOnlyAdmin)
    for user in (alice, root):
        request = asked_by(user)
        assert page.has_add_permission(request) is False
        assert page.has_change_permission(request) is False
        assert page.has_delete_permission(request) is False


@pytest.mark.django_db
def test_an_agents_version_is_not_deleted_by_an_admin_of_its_organisation(acme, alice):
    agent = services.create_agent(acme, "Builder")
    version = agent.versions.get()
    page = admin.site._registry[AgentVersion]
    assert page.has_view_permission(asked_by(alice), version) is True
    assert page.has_delete_permission(asked_by(alice), version) is False
    assert page.has_change_permission(asked_by(alice), version) is False
