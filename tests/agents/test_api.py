"""The API for organisations and agents: shapes, versioning, bad input, tenancy and roles."""

import pytest
from django.contrib.auth.models import Permission
from django.test import override_settings

from agents.models import Agent, AgentVersion
from organisations.models import Organisation
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory, WorkplaceFactory

pytestmark = pytest.mark.django_db


def test_a_new_organisation_gets_the_configured_base_allowlist(api, root):
    response = api(root).post("/api/v1/organisations/", {"name": "Initech"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert isinstance(body["id"], int)
    assert body["base_allowlist"] == ["api.anthropic.com"]
    assert body["slug"] == "initech"


@override_settings(COVEY_EGRESS_BASE_ALLOWLIST=["Models.Example.", "mirror.example:8443"])
def test_the_base_allowlist_comes_from_the_setting_normalised(api, root):
    body = api(root).post("/api/v1/organisations/", {"name": "Initech"}, format="json").json()
    assert body["base_allowlist"] == ["mirror.example:8443", "models.example"]


def test_the_creator_of_an_organisation_becomes_its_admin(api, nobody):
    nobody.user_permissions.add(Permission.objects.get(codename="add_organisation"))
    response = api(nobody).post("/api/v1/organisations/", {"name": "Initech"}, format="json")
    assert response.status_code == 201
    org_id = response.json()["id"]
    assert api(nobody).get(f"/api/v1/organisations/{org_id}/").status_code == 200
    patch = api(nobody).patch(
        f"/api/v1/organisations/{org_id}/", {"base_allowlist": ["a.example"]}, format="json"
    )
    assert patch.json()["base_allowlist"] == ["a.example"]


def test_creating_an_organisation_needs_the_platform_permission(api, alice):
    response = api(alice).post("/api/v1/organisations/", {"name": "Initech"}, format="json")
    assert response.status_code == 403
    assert not Organisation.objects.filter(name="Initech").exists()


def test_a_duplicate_organisation_name_is_a_field_error(api, root, acme):
    for name in ("Acme", "ACME"):  # the second one would take the same slug
        response = api(root).post("/api/v1/organisations/", {"name": name}, format="json")
        assert response.status_code == 400
        assert "exists already" in response.json()["name"][0]
    assert Organisation.objects.count() == 1


def test_a_bad_base_allowlist_is_refused_and_nothing_changes(api, alice, acme):
    response = api(alice).patch(
        f"/api/v1/organisations/{acme.pk}/",
        {"name": "Acme Two", "base_allowlist": ["ok.example", "*.bad.example"]},
        format="json",
    )
    assert response.status_code == 400
    assert "wildcard" in str(response.json()["base_allowlist"])
    acme.refresh_from_db()
    assert acme.name == "Acme"
    assert acme.base_allowlist == ["api.anthropic.com"]


def create_agent(client, organisation, **fields):
    payload = {"organisation": organisation.pk, "name": "builder", **fields}
    return client.post("/api/v1/agents/", payload, format="json")


def test_creating_an_agent_returns_its_id_enabled_state_and_version(api, alice, acme):
    response = create_agent(
        api(alice), acme, templates=["npm", "pypi"], allowlist=["Git.Example.COM", "x.example:80"]
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert isinstance(body["id"], int)
    assert body["enabled"] is True
    assert body["version"] == 1
    assert body["templates"] == ["npm", "pypi"]
    assert body["allowlist"] == ["git.example.com", "x.example:80"]
    assert body["slug"] == "builder"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"enabled": False}, {"enabled": False}),
        ({"templates": ["github"]}, {"templates": ["github"]}),
        ({"allowlist": ["new.example"]}, {"allowlist": ["new.example"]}),
        ({"name": "renamed"}, {"name": "renamed"}),
        ({"required_labels": ["GPU", "eu"]}, {"required_labels": ["eu", "gpu"]}),
    ],
)
def test_each_change_to_an_agent_creates_a_new_version(api, alice, acme, change, expected):
    client = api(alice)
    agent = create_agent(client, acme, templates=["npm"], allowlist=["old.example"]).json()
    response = client.patch(f"/api/v1/agents/{agent['id']}/", change, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["version"] == 2
    for key, value in expected.items():
        assert body[key] == value
    versions = client.get(f"/api/v1/agents/{agent['id']}/versions/").json()["results"]
    assert [v["number"] for v in versions] == [2, 1]
    assert versions[0]["created_by"] == "alice"
    (field,) = versions[0]["changes"]
    assert field in change


def test_a_new_allowlist_replaces_the_agents_own_entries(api, alice, acme):
    client = api(alice)
    agent = create_agent(client, acme, allowlist=["a.example", "b.example"]).json()
    client.patch(f"/api/v1/agents/{agent['id']}/", {"allowlist": ["c.example"]}, format="json")
    entries = client.get(f"/api/v1/agents/{agent['id']}/effective-allowlist/").json()["entries"]
    assert "c.example:443" in entries
    assert "a.example:443" not in entries


def test_a_change_that_changes_nothing_creates_no_version(api, alice, acme):
    client = api(alice)
    agent = create_agent(client, acme, allowlist=["a.example"]).json()
    response = client.patch(
        f"/api/v1/agents/{agent['id']}/", {"allowlist": ["A.example."]}, format="json"
    )
    assert response.json()["version"] == 1
    assert AgentVersion.objects.filter(agent_id=agent["id"]).count() == 1


def test_versions_can_be_compared(api, alice, acme):
    client = api(alice)
    agent = create_agent(client, acme, templates=["npm"]).json()
    url = f"/api/v1/agents/{agent['id']}/"
    client.patch(url, {"enabled": False}, format="json")
    client.patch(url, {"templates": ["npm", "go"]}, format="json")
    body = client.get(f"{url}compare/?from=1&to=3").json()
    assert body["changes"] == {"enabled": [True, False], "templates": [["npm"], ["go", "npm"]]}
    assert client.get(f"{url}compare/?from=1&to=9").status_code == 404
    assert client.get(f"{url}compare/?from=x&to=2").status_code == 400


def test_the_effective_allowlist_is_base_templates_and_own_normalised_and_sorted(api, alice, acme):
    AllowlistTemplate.objects.filter(slug="npm").update(entries=["registry.example", "b.example"])
    client = api(alice)
    agent = create_agent(
        client, acme, templates=["npm"], allowlist=["b.example", "z.example:8080"]
    ).json()
    body = client.get(f"/api/v1/agents/{agent['id']}/effective-allowlist/").json()
    assert body["entries"] == [
        "api.anthropic.com:443",
        "b.example:443",
        "registry.example:443",
        "z.example:8080",
    ]
    assert body["sources"]["b.example:443"] == ["template:npm", "agent"]
    assert body["sources"]["api.anthropic.com:443"] == ["base"]


@pytest.mark.parametrize(
    ("fields", "bad_field", "words"),
    [
        ({"allowlist": ["ok.example", "10.0.0.1"]}, "allowlist", "IP address"),
        ({"allowlist": ["*.example.com"]}, "allowlist", "wildcard"),
        ({"allowlist": "one.example"}, "allowlist", "list"),
        ({"allowlist": ["x.example:70000"]}, "allowlist", "port"),
        ({"templates": ["npm", "no-such-template"]}, "templates", "no-such-template"),
        ({"required_labels": ["bad label"]}, "required_labels", "not a label"),
        ({"name": ""}, "name", "blank"),
        ({"name": "!!!"}, "name", "letter or digit"),
        ({"enabled": "perhaps"}, "enabled", "boolean"),
    ],
)
def test_bad_input_is_a_field_error_and_nothing_is_saved(
    api, alice, acme, fields, bad_field, words
):
    response = create_agent(api(alice), acme, **fields)
    assert response.status_code == 400
    assert words.lower() in str(response.json()[bad_field]).lower()
    assert Agent.objects.count() == 0
    assert AgentVersion.objects.count() == 0


def test_a_bad_change_leaves_the_agent_and_its_versions_as_they_were(api, alice, acme):
    client = api(alice)
    agent = create_agent(client, acme, templates=["npm"], allowlist=["a.example"]).json()
    response = client.patch(
        f"/api/v1/agents/{agent['id']}/",
        {"enabled": False, "templates": ["go"], "allowlist": ["a.example", "0x7f.1"]},
        format="json",
    )
    assert response.status_code == 400
    after = client.get(f"/api/v1/agents/{agent['id']}/").json()
    assert after == agent


def test_a_duplicate_agent_name_is_a_field_error(api, alice, acme):
    client = api(alice)
    assert create_agent(client, acme).status_code == 201
    for name in ("builder", "Builder"):
        response = create_agent(client, acme, name=name)
        assert response.status_code == 400
        assert "exists already" in response.json()["name"][0]
    assert Agent.objects.count() == 1


def test_the_same_agent_name_is_fine_in_another_organisation(api, alice, gary, acme, globex):
    assert create_agent(api(alice), acme).status_code == 201
    assert create_agent(api(gary), globex).status_code == 201


def test_an_agent_cannot_move_to_another_organisation(api, root, acme, globex):
    agent = AgentFactory(organisation=acme)
    response = api(root).patch(
        f"/api/v1/agents/{agent.pk}/", {"organisation": globex.pk}, format="json"
    )
    assert response.status_code == 400
    assert "another organisation" in str(response.json()["organisation"])


def test_a_workplace_of_another_organisation_is_refused(api, root, acme, globex):
    theirs = WorkplaceFactory(organisation=globex)
    response = create_agent(api(root), acme, workplace=theirs.pk)
    assert response.status_code == 400
    assert "another organisation" in str(response.json()["workplace"])


class TestTenancy:
    """A member of one organisation gets 404 for everything of another."""

    def test_a_member_of_another_organisation_gets_404_for_an_agent(self, api, gary, acme):
        agent = AgentFactory(organisation=acme)
        client = api(gary)
        for suffix in ("", "versions/", "effective-allowlist/", "compare/?from=1&to=1"):
            assert client.get(f"/api/v1/agents/{agent.pk}/{suffix}").status_code == 404
        assert client.patch(f"/api/v1/agents/{agent.pk}/", {"enabled": False}).status_code == 404
        assert client.delete(f"/api/v1/agents/{agent.pk}/").status_code == 404
        assert Agent.objects.get(pk=agent.pk).enabled is True

    def test_lists_show_only_your_organisations(self, api, alice, gary, acme, globex):
        AgentFactory(organisation=acme, name="acme-agent")
        AgentFactory(organisation=globex, name="globex-agent")
        names = [a["name"] for a in api(gary).get("/api/v1/agents/").json()["results"]]
        assert names == ["globex-agent"]
        orgs = [o["name"] for o in api(alice).get("/api/v1/organisations/").json()["results"]]
        assert orgs == ["Acme"]

    def test_someone_in_no_organisation_sees_nothing(self, api, nobody, acme):
        AgentFactory(organisation=acme)
        assert api(nobody).get("/api/v1/agents/").json()["count"] == 0
        assert api(nobody).get("/api/v1/organisations/").json()["count"] == 0
        assert api(nobody).get(f"/api/v1/organisations/{acme.pk}/").status_code == 404

    def test_you_cannot_create_an_agent_in_another_organisation(self, api, gary, acme):
        response = create_agent(api(gary), acme)
        assert response.status_code == 400
        assert "does not exist" in str(response.json()["organisation"])
        assert Agent.objects.count() == 0

    def test_the_superuser_sees_every_organisation(self, api, root, acme, globex):
        assert api(root).get("/api/v1/organisations/").json()["count"] == 2

    def test_requests_without_a_token_are_refused(self, client, acme):
        assert client.get("/api/v1/agents/").status_code in (401, 403)
        response = client.get("/api/v1/agents/", HTTP_AUTHORIZATION="Token not-a-real-key")
        assert response.status_code == 401


class TestRoles:
    """Viewers and approvers read; only admins change."""

    @pytest.mark.parametrize("persona", ["vera", "april"])
    def test_readers_read_but_cannot_change(self, api, request, acme, persona):
        user = request.getfixturevalue(persona)
        agent = AgentFactory(organisation=acme)
        client = api(user)
        assert client.get(f"/api/v1/agents/{agent.pk}/").status_code == 200
        response = client.patch(f"/api/v1/agents/{agent.pk}/", {"enabled": False}, format="json")
        assert response.status_code == 403
        response = client.patch(
            f"/api/v1/organisations/{acme.pk}/", {"base_allowlist": []}, format="json"
        )
        assert response.status_code == 403
        response = create_agent(client, acme)
        assert response.status_code == 400
        assert "role" in str(response.json()["organisation"])
        agent.refresh_from_db()
        assert (agent.enabled, agent.version) == (True, 1)

    def test_an_admin_can_delete_an_agent(self, api, alice, acme):
        agent = AgentFactory(organisation=acme)
        assert api(alice).delete(f"/api/v1/agents/{agent.pk}/").status_code == 204
        assert not Agent.objects.filter(pk=agent.pk).exists()


@pytest.mark.parametrize(
    "command",
    ["echo hi", ["echo", 1], ["echo", None], [["nested"]], {"cmd": "x"}],
)
def test_a_runtime_command_must_be_a_list_of_strings(api, alice, acme, command):
    agent = AgentFactory(organisation=acme)
    response = api(alice).patch(
        f"/api/v1/agents/{agent.pk}/", {"runtime_command": command}, format="json"
    )
    assert response.status_code == 400
    assert "a JSON list of arguments" in response.json()["runtime_command"][0]
    agent.refresh_from_db()
    assert agent.version == 1


class TestDeletingWhatOthersDependOn:
    """A delete that other rows still depend on answers 409 saying what, and deletes nothing."""

    def test_an_agent_with_runs_is_kept_as_their_record(self, api, alice, acme, orders):
        from runs import services as runs

        agent = AgentFactory(organisation=acme)
        runs.queue_run(agent, "one")
        runs.queue_run(agent, "two")
        response = api(alice).delete(f"/api/v1/agents/{agent.pk}/")
        assert response.status_code == 409
        assert response.json()["detail"] == "cannot delete it: 2 runs still depend on it"
        assert Agent.objects.filter(pk=agent.pk).exists()

    def test_a_workplace_in_use_is_kept(self, api, alice, acme):
        workplace = WorkplaceFactory(organisation=acme)
        AgentFactory(organisation=acme, workplace=workplace)
        response = api(alice).delete(f"/api/v1/workplaces/{workplace.pk}/")
        assert response.status_code == 409
        assert response.json()["detail"] == "cannot delete it: 1 agent still depends on it"

    def test_an_organisation_with_agents_is_kept_and_an_empty_one_goes(self, api, root, acme):
        from runners.models import Runner

        AgentFactory(organisation=acme)
        WorkplaceFactory(organisation=acme)
        response = api(root).delete(f"/api/v1/organisations/{acme.pk}/")
        assert response.status_code == 409
        assert response.json()["detail"] == (
            "cannot delete it: 1 agent and 1 workplace still depend on it"
        )
        assert Organisation.objects.filter(pk=acme.pk).exists()
        assert Runner.objects.filter(organisation=acme, builtin=True).exists()  # rolled back
        empty = api(root).post("/api/v1/organisations/", {"name": "Empty"}, format="json")
        assert api(root).delete(f"/api/v1/organisations/{empty.json()['id']}/").status_code == 204
        assert not Runner.objects.filter(organisation_id=empty.json()["id"]).exists()

    def test_deleting_an_organisation_is_for_the_platform_team(self, api, alice, acme):
        response = api(alice).delete(f"/api/v1/organisations/{acme.pk}/")
        assert response.status_code == 403
        assert "organisations.delete_organisation" in response.json()["detail"]
