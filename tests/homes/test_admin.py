"""The audit of changes to a home, in the admin: said for people ("uploaded, 3.0 MiB",
"refused: …"), not as the HTTP status and byte count it keeps."""

import pytest

from homes.models import HomeChange
from runners.protocol import HomeOp
from runs import services as runs
from runs.models import Run, RunStatus
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db

QUOTA = "the home holds 9.9 GiB of its quota of 10.0 GiB: 3.0 MiB more would pass it"


@pytest.fixture
def audited(acme):
    agent = AgentFactory(organisation=acme, name="Keeper")
    made = {"agent": agent, "by_name": "alice", "settled": True}
    HomeChange.objects.create(
        **made, operation=HomeOp.WRITE, path="report.txt", bytes=3 * 1024 * 1024, status=201
    )
    HomeChange.objects.create(
        **made, operation=HomeOp.WRITE, path="big.bin", bytes=3145728, status=413, detail=QUOTA
    )
    HomeChange.objects.create(**made, operation=HomeOp.MKDIR, path="notes", status=201)
    HomeChange.objects.create(
        **made, operation=HomeOp.MOVE, path="notes", target="old-notes", status=200
    )
    HomeChange.objects.create(
        **made, operation=HomeOp.DELETE, path="tmp", status=502, detail="the runner broke off"
    )
    HomeChange.objects.create(agent=agent, by_name="alice", operation=HomeOp.DELETE, path="x")
    return agent


SAID = [
    "uploaded, 3.0 MiB",
    f"refused: {QUOTA}",
    "made",
    "moved",
    "failed: the runner broke off",
    "waiting for its runner to answer",
]


def test_the_homes_page_says_how_each_change_went_in_words(operator_client, audited):
    page = operator_client.get(f"/admin/homes/home/{audited.pk}/change/").content.decode()
    changes = page[page.index('id="home-changes"') :]
    for said in SAID:
        assert said in changes, said
    assert "new directory" in changes and "old-notes" in changes
    assert "3145728" not in changes and ">201<" not in changes and "413" not in changes


def test_the_audit_list_says_how_each_change_went_in_words(operator_client, audited):
    listed = operator_client.get("/admin/homes/homechange/").content.decode()
    for said in SAID:
        assert said in listed, said
    assert "3145728" not in listed
    refused = operator_client.get("/admin/homes/homechange/", {"went": "refused"})
    assert "big.bin" in refused.content.decode()
    assert "report.txt" not in refused.content.decode()


def test_a_change_refused_for_a_viewer_in_the_browser_is_a_styled_page_and_in_the_audit(
    client, acme, vera
):
    agent = AgentFactory(organisation=acme, name="Builder")
    client.force_login(vera)
    answer = client.post(f"/admin/homes/home/{agent.pk}/mkdir/", {"path": "src", "name": "new"})
    assert answer.status_code == 403
    page = answer.content.decode()
    assert "admin/css/base.css" in page and "takes the admin role in Acme" in page
    (refused,) = HomeChange.objects.filter(agent=agent)
    assert (refused.operation, refused.path, refused.status, refused.by_name) == (
        HomeOp.MKDIR, "src/new", 403, "vera",
    )  # fmt: skip
    moved = client.post(f"/admin/homes/home/{agent.pk}/rename/?path=a", {"target": "b"})
    assert moved.status_code == 403
    assert HomeChange.objects.filter(agent=agent, operation=HomeOp.MOVE, target="b").exists()
    uploaded = client.post(f"/admin/homes/home/{agent.pk}/upload/", {"path": "x"})
    assert uploaded.status_code == 403
    assert HomeChange.objects.filter(agent=agent, operation=HomeOp.WRITE, status=403).exists()


def test_the_browser_offers_no_change_while_a_run_holds_the_home(
    client, acme, alice, orders, settings
):
    agent = AgentFactory(organisation=acme, name="Builder")
    client.force_login(alice)
    page = client.get(f"/admin/homes/home/{agent.pk}/change/").content.decode()
    assert 'id="home-upload"' in page and 'id="home-mkdir"' in page
    run = runs.queue_run(agent, "work")
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    page = client.get(f"/admin/homes/home/{agent.pk}/change/").content.decode()
    assert "the home is read-only until it ends" in page
    assert 'id="home-upload"' not in page and 'id="home-mkdir"' not in page
    settings.COVEY_HOME_WRITES_DURING_RUNS = True
    page = client.get(f"/admin/homes/home/{agent.pk}/change/").content.decode()
    assert 'id="home-upload"' in page


def test_a_home_of_another_organisation_or_none_is_said_not_to_exist(client, acme, globex, alice):
    theirs = AgentFactory(organisation=globex, name="Theirs")
    client.force_login(alice)
    for pk in (theirs.pk, 987654, "x1"):
        answer = client.get(f"/admin/homes/home/{pk}/change/", follow=True)
        assert answer.redirect_chain[-1][0] == "/admin/", pk
        assert "doesn’t exist" in answer.content.decode()


def test_the_browser_takes_no_unicode_digit_for_a_number(client, acme, alice):
    agent = AgentFactory(organisation=acme, name="Builder")
    client.force_login(alice)
    assert client.get(f"/admin/homes/home/{agent.pk}/change/?offset=²").status_code == 200
    assert client.get("/admin/homes/home/²/change/", follow=True).redirect_chain[-1][0] == "/admin/"
