"""The record of credentialed requests: every member of the organisation reads it, in the admin
(its own list, and on the run's and the agent's pages) and in the API; refused ones stand out;
nobody changes it; another organisation's is not there."""

import pytest
from django.utils import timezone

from agents import services as agent_services
from connections import services
from connections.models import CredentialedRequest
from runs import services as runs
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db

OLD, NEW = "1" * 40, "2" * 40


@pytest.fixture
def records(acme, globex):
    """Acme's agent pushed once (one ref refused) and fetched once; Globex's fetched."""
    forge = services.create_connection(
        acme, "forge", "token", "t0ken", git_url="https://git.example", scheme="bearer"
    )
    agent = AgentFactory(organisation=acme, name="Builder")
    run = runs.queue_run(agent, "push it")
    refused = "protected by covey: the default branch (HEAD) is never pushed to by an agent"
    pushed = CredentialedRequest.objects.create(
        organisation=acme, agent=agent, run=run, connection=forge, at=timezone.now(),
        method="POST", host="git.example", repository="acme/app", service="git-receive-pack",
        status=200, refused=refused,
        refs=[{"ref": "refs/heads/main", "old": OLD, "new": NEW, "refused": refused}],
    )  # fmt: skip
    fetched = CredentialedRequest.objects.create(
        organisation=acme, agent=agent, run=run, connection=forge, at=timezone.now(),
        method="POST", host="git.example", repository="acme/app", service="git-upload-pack",
        status=200,
    )  # fmt: skip
    theirs = AgentFactory(organisation=globex, name="Other")
    CredentialedRequest.objects.create(
        organisation=globex, agent=theirs, at=timezone.now(), method="GET",
        host="git.example", repository="globex/hidden", service="git-upload-pack", status=404,
        refused="not granted",
    )  # fmt: skip
    return agent, run, pushed, fetched


def test_members_list_their_organisation_s_record_and_filter_the_refused(api, vera, records):
    _, run, pushed, fetched = records
    client = api(vera)
    listed = client.get("/api/v1/credentialed-requests/").json()["results"]
    assert [r["id"] for r in listed] == [fetched.pk, pushed.pk]  # newest first, Acme's only
    refused = client.get("/api/v1/credentialed-requests/", {"refused": "true"}).json()["results"]
    assert [(r["id"], r["refs"][0]["ref"]) for r in refused] == [(pushed.pk, "refs/heads/main")]
    of_run = client.get("/api/v1/credentialed-requests/", {"run": str(run.pk)}).json()
    assert of_run["count"] == 2
    assert client.post("/api/v1/credentialed-requests/", {}).status_code == 405
    assert client.delete(f"/api/v1/credentialed-requests/{pushed.pk}/").status_code == 405


def test_another_organisation_s_record_is_not_there(api, gary, records):
    _, _, pushed, _ = records
    client = api(gary)
    assert client.get(f"/api/v1/credentialed-requests/{pushed.pk}/").status_code == 404
    listed = client.get("/api/v1/credentialed-requests/").json()["results"]
    assert [r["repository"] for r in listed] == ["globex/hidden"]


def test_a_viewer_reads_the_record_in_the_admin_and_refusals_stand_out(client, vera, records):
    agent, run, pushed, _ = records
    client.force_login(vera)
    listed = client.get("/admin/connections/credentialedrequest/").content.decode()
    assert "push git.example/acme/app" in listed and "fetch git.example/acme/app" in listed
    assert 'font-weight: bold">refused</span>: protected by covey' in listed
    assert "globex/hidden" not in listed
    only = client.get("/admin/connections/credentialedrequest/", {"outcome": "refused"})
    assert "fetch git.example" not in only.content.decode()
    page = client.get(f"/admin/connections/credentialedrequest/{pushed.pk}/change/")
    text = page.content.decode()
    assert page.status_code == 200 and "refs/heads/main" in text and NEW[:12] in text
    assert 'name="_save"' not in text  # a record: nothing to save
    run_page = client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "2 request(s), 1 refused" in run_page
    agent_page = client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert "2 request(s), 1 refused" in agent_page
    followed = client.get(f"/admin/connections/credentialedrequest/?run__id__exact={run.pk}")
    assert followed.status_code == 200 and "push git.example/acme/app" in followed.content.decode()


def test_another_organisation_s_record_is_not_in_the_admin(client, gary, records):
    _, _, pushed, _ = records
    client.force_login(gary)
    page = client.get(f"/admin/connections/credentialedrequest/{pushed.pk}/change/")
    assert page.status_code in (302, 404)
    listed = client.get("/admin/connections/credentialedrequest/").content.decode()
    assert "globex/hidden" in listed and "acme/app" not in listed


def test_the_organisation_s_credential_history_shows_connections_rotations_and_grants(
    client, alice, vera, gary, acme
):
    forge = services.create_connection(
        acme, "forge", "token", "t0ken", git_url="https://git.example", by=alice
    )
    services.rotate_secret(forge, "n3w-t0ken", by=alice)
    agent = AgentFactory(organisation=acme, name="Builder")
    agent_services.update_agent(
        agent, by=alice, credential_grants=[{"connection": "forge", "repositories": ["acme/app"]}]
    )
    client.force_login(vera)
    org_page = client.get(f"/admin/organisations/organisation/{acme.pk}/change/").content.decode()
    url = f"/admin/agents/agent/credentials/{acme.pk}/"
    assert url in org_page
    page = client.get(url)
    text = page.content.decode()
    assert page.status_code == 200
    for said in ("connection forge made", "credential of forge rotated", "grants of Builder"):
        assert said in text
    assert "t0ken" not in text and "n3w-t0ken" not in text and "alice" in text
    client.force_login(gary)
    assert client.get(url).status_code == 404
