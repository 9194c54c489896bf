"""Connections: each kind's fields checked, the credential encrypted and never returned, who may
make, change, rotate and delete them (API and admin), and grants on agents that name them."""

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from django.core.exceptions import ValidationError

from agents import services as agents
from connections import services
from connections.models import Connection
from covey.crypto import decrypt
from tests.connections.keys import pem

pytestmark = pytest.mark.django_db
TOKEN = "glpat-a-token-only-the-test-knows"


@pytest.fixture(scope="module")
def app_key() -> str:
    return pem(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def gitlab(organisation, **fields):
    fields.setdefault("git_url", "https://gitlab.example")
    return services.create_connection(organisation, "gitlab", "token", TOKEN, **fields)


def test_a_github_app_gets_github_s_urls_and_its_key_is_kept_encrypted(acme, alice, app_key):
    made = services.create_connection(
        acme, "github", "github-app", app_key, by=alice, app_id="12", installation_id="34"
    )
    assert (made.git_url, made.api_url, made.host) == (
        "https://github.com",
        "https://api.github.com",
        "github.com",
    )
    stored = Connection.objects.get(pk=made.pk).secret
    assert "PRIVATE KEY" not in stored
    assert decrypt(stored) == app_key
    (record,) = made.history.all()
    assert (record.history_type, record.history_user) == ("+", alice)


def test_a_token_a_registry_and_a_host_with_a_port(acme):
    token = gitlab(
        acme, git_url="https://git.example:8443/", scheme="header", header="PRIVATE-TOKEN"
    )
    assert token.host == "git.example:8443"
    registry = services.create_connection(
        acme, "pypi", "basic", "a-password", index_url="https://pypi.example", username="ci"
    )
    assert (registry.paths, registry.host) == (["/"], "")


@pytest.mark.parametrize(
    ("kind", "secret", "fields", "field", "says"),
    [
        ("github-app", "not a key", {"app_id": "1", "installation_id": "2"}, "secret", "PEM"),
        ("github-app", "KEY", {"app_id": "x", "installation_id": "2"}, "app_id", "number"),
        (
            "github-app",
            "KEY",
            {"app_id": "1", "installation_id": "2", "username": "u"},
            "username",
            "has no user name",
        ),
        ("github-app", "EC", {"app_id": "1", "installation_id": "2"}, "secret", "RSA key"),
        ("token", "two words", {"git_url": "https://g.example"}, "secret", "one line"),
        ("token", "", {"git_url": "https://g.example"}, "secret", "give the credential"),
        ("token", "t", {}, "git_url", "git URL, its API URL, or both"),
        ("token", "t", {"git_url": "http://g.example"}, "git_url", "https only"),
        ("token", "t", {"git_url": "https://u:p@g.example"}, "git_url", "no user name"),
        ("token", "t", {"git_url": "https://g.example/?a=1"}, "git_url", "no query"),
        ("token", "t", {"git_url": "https://g.example:99999"}, "git_url", "port"),
        ("token", "t", {"api_url": "https://a.example", "scheme": "basic"}, "username", "user"),
        (
            "token",
            "t",
            {"api_url": "https://a.example", "scheme": "header", "header": "Host"},
            "header",
            "header name",
        ),
        ("token", "t", {"api_url": "https://a.example", "header": "X-Token"}, "header", "only"),
        ("basic", "p", {"username": "u"}, "index_url", "root"),
        (
            "basic",
            "p",
            {"index_url": "https://r.example", "username": "u", "paths": ["x"]},
            "paths",
            'start with "/"',
        ),
        (
            "basic",
            "p",
            {"index_url": "https://r.example", "username": "u", "paths": ["/../a"]},
            "paths",
            'start with "/"',
        ),
        ("basic", "p", {"index_url": "https://r.example"}, "username", "user name"),
        (
            "basic",
            "p",
            {"index_url": "https://r.example", "username": "a:b"},
            "username",
            "has no ':'",
        ),
        ("nope", "p", {}, "kind", "not a valid choice"),
    ],
)
def test_what_a_kind_cannot_use_is_refused_per_field_and_nothing_is_saved(
    acme, app_key, kind, secret, fields, field, says
):
    secret = {"KEY": app_key, "EC": pem(ec.generate_private_key(ec.SECP256R1()))}.get(
        secret, secret
    )
    with pytest.raises(ValidationError) as refused:
        services.create_connection(acme, "it", kind, secret, **fields)
    assert field in refused.value.message_dict, refused.value.message_dict
    assert says in " ".join(refused.value.message_dict[field])
    assert not Connection.objects.exists()


def test_names_are_unique_in_an_organisation_only(acme, globex):
    gitlab(acme)
    gitlab(globex)
    with pytest.raises(ValidationError, match="exists already"):
        gitlab(acme)


def test_a_rotation_is_on_the_history_and_forgets_what_the_upstream_said(acme, alice):
    made = gitlab(acme)
    Connection.objects.filter(pk=made.pk).update(status="token refused by gitlab.example")
    rotated = services.rotate_secret(made, "glpat-the-new-one", by=alice)
    assert decrypt(rotated.secret) == "glpat-the-new-one"
    assert rotated.status == ""
    latest = rotated.history.first()
    assert (latest.history_type, latest.history_user) == ("~", alice)
    assert latest.secret_set_at == rotated.secret_set_at
    assert not hasattr(latest, "secret")  # the history never holds the credential
    with pytest.raises(ValidationError, match="one line"):
        services.rotate_secret(made, "two words")
    assert decrypt(Connection.objects.get(pk=made.pk).secret) == "glpat-the-new-one"


def test_grants_name_connections_of_their_own_organisation(acme, globex):
    gitlab(globex)
    with pytest.raises(ValidationError, match="no connection named 'gitlab'"):
        agents.create_agent(
            acme, "Builder", credential_grants=[{"connection": "gitlab", "repositories": ["a/b"]}]
        )
    gitlab(acme)
    agent = agents.create_agent(
        acme, "Builder", credential_grants=[{"connection": "gitlab", "repositories": ["a/b"]}]
    )
    (grant,) = agent.credential_grants
    assert grant["push"] == ["covey/builder/*"]
    assert agent.versions.get().config["credential_grants"] == [grant]


def test_a_connection_agents_grants_name_is_not_renamed_or_deleted(acme):
    connection = gitlab(acme)
    agent = agents.create_agent(
        acme, "Builder", credential_grants=[{"connection": "gitlab", "repositories": ["a/b"]}]
    )
    with pytest.raises(ValidationError, match=r"grants name it \(builder\)"):
        services.update_connection(connection, name="gitlab-2")
    with pytest.raises(ValidationError, match=r"grants name it \(builder\)"):
        services.delete_connection(connection)
    agents.update_agent(agent, credential_grants=[])
    services.delete_connection(connection)
    assert not Connection.objects.exists()


# --- the API ---------------------------------------------------------------------------------


def body(organisation, **fields):
    return {
        "organisation": organisation.pk,
        "name": "gitlab",
        "kind": "token",
        "git_url": "https://gitlab.example",
        "secret": TOKEN,
        **fields,
    }


def test_an_admin_makes_a_connection_and_no_answer_holds_its_credential(api, alice, vera, acme):
    client = api(alice)
    made = client.post("/api/v1/connections/", body(acme), format="json")
    assert made.status_code == 201, made.content
    assert TOKEN not in made.content.decode()
    assert made.json()["host"] == "gitlab.example"
    assert made.json()["scheme"] == "bearer"
    for user in (alice, vera):
        listed = api(user).get("/api/v1/connections/")
        assert listed.status_code == 200
        assert TOKEN not in listed.content.decode()
        assert [c["name"] for c in listed.json()["results"]] == ["gitlab"]


def test_only_admins_make_change_rotate_and_delete(api, april, vera, alice, acme):
    for user in (april, vera):
        refused = api(user).post("/api/v1/connections/", body(acme), format="json")
        assert refused.status_code == 400
        assert "does not allow this" in refused.content.decode()
    pk = api(alice).post("/api/v1/connections/", body(acme), format="json").json()["id"]
    for user in (april, vera):
        client = api(user)
        url = f"/api/v1/connections/{pk}/"
        assert client.patch(url, {"api_url": "https://x.example"}, format="json").status_code == 403
        assert client.post(f"{url}rotate/", {"secret": "x"}, format="json").status_code == 403
        assert client.delete(url).status_code == 403
    assert decrypt(Connection.objects.get().secret) == TOKEN


def test_another_organisation_s_connection_is_not_there(api, gary, alice, acme):
    pk = api(alice).post("/api/v1/connections/", body(acme), format="json").json()["id"]
    client = api(gary)
    assert client.get(f"/api/v1/connections/{pk}/").status_code == 404
    assert client.post(f"/api/v1/connections/{pk}/rotate/", {"secret": "x"}).status_code == 404
    assert client.get("/api/v1/connections/").json()["results"] == []


def test_an_update_changes_fields_but_never_the_credential_or_kind(api, alice, acme):
    client = api(alice)
    pk = client.post("/api/v1/connections/", body(acme), format="json").json()["id"]
    url = f"/api/v1/connections/{pk}/"
    changed = client.patch(url, {"api_url": "https://gitlab.example/api/v4"}, format="json")
    assert changed.status_code == 200, changed.content
    for change, field in (({"secret": "other"}, "secret"), ({"kind": "basic"}, "kind")):
        refused = client.patch(url, change, format="json")
        assert refused.status_code == 400
        assert field in refused.json()
    refused = client.patch(url, {"git_url": "http://gitlab.example"}, format="json")
    assert refused.status_code == 400
    assert "https only" in refused.content.decode()
    rotated = client.post(f"{url}rotate/", {"secret": "glpat-new"}, format="json")
    assert rotated.status_code == 200
    assert "glpat-new" not in rotated.content.decode()
    assert decrypt(Connection.objects.get().secret) == "glpat-new"
    refused = client.post(f"{url}rotate/", {"secret": "glpat-x", "extra": 1}, format="json")
    assert refused.status_code == 400
    deleted = client.delete(url)
    assert deleted.status_code == 204


def test_an_agent_s_grants_are_set_through_the_api(api, alice, acme):
    client = api(alice)
    client.post("/api/v1/connections/", body(acme), format="json")
    made = client.post(
        "/api/v1/agents/",
        {
            "organisation": acme.pk,
            "name": "Builder",
            "credential_grants": [{"connection": "gitlab", "repositories": ["acme/app"]}],
        },
        format="json",
    )
    assert made.status_code == 201, made.content
    assert made.json()["credential_grants"][0]["protected"] == ["HEAD", "refs/tags/*"]
    refused = client.patch(
        f"/api/v1/agents/{made.json()['id']}/",
        {"credential_grants": [{"connection": "gitlab", "repositories": ["acme"]}]},
        format="json",
    )
    assert refused.status_code == 400
    assert "grant 1: repository 'acme'" in refused.json()["credential_grants"][0]


# --- the admin -------------------------------------------------------------------------------


def test_an_admin_adds_and_rotates_in_the_admin_and_never_sees_the_credential(client, alice, acme):
    client.force_login(alice)
    added = client.post(
        "/admin/connections/connection/add/",
        {
            "organisation": acme.pk,
            "name": "gitlab",
            "kind": "token",
            "git_url": "https://gitlab.example",
            "scheme": "bearer",
            "paths": "[]",
            "credential": TOKEN,
        },
    )
    assert added.status_code == 302, added.content.decode()[-3000:]
    connection = Connection.objects.get()
    page = client.get(f"/admin/connections/connection/{connection.pk}/change/")
    assert page.status_code == 200
    assert TOKEN not in page.content.decode()
    assert connection.secret not in page.content.decode()
    form = {
        "organisation": acme.pk,
        "name": "gitlab",
        "kind": "token",
        "git_url": "https://gitlab.example",
        "scheme": "bearer",
        "paths": "[]",
        "credential": "glpat-rotated",
    }
    changed = client.post(f"/admin/connections/connection/{connection.pk}/change/", form)
    assert changed.status_code == 302, changed.context["adminform"].form.errors
    assert decrypt(Connection.objects.get().secret) == "glpat-rotated"


def test_the_admin_form_says_what_the_service_would_refuse(client, alice, acme):
    client.force_login(alice)
    refused = client.post(
        "/admin/connections/connection/add/",
        {
            "organisation": acme.pk,
            "name": "gh",
            "kind": "github-app",
            "app_id": "x",
            "installation_id": "1",
            "paths": "[]",
            "credential": "not a key",
        },
    )
    assert refused.status_code == 200
    text = refused.content.decode()
    assert "the number GitHub shows for it" in text
    assert "the app&#x27;s private key, in PEM" in text
    assert not Connection.objects.exists()


def test_a_viewer_reads_connections_in_the_admin_and_a_second_organisation_stays_apart(
    client, vera, acme, globex
):
    gitlab(acme)
    services.create_connection(globex, "theirs", "token", TOKEN, git_url="https://g.example")
    client.force_login(vera)
    listed = client.get("/admin/connections/connection/")
    assert listed.status_code == 200
    assert "gitlab" in listed.content.decode()
    assert "theirs" not in listed.content.decode()
    mine = Connection.objects.get(name="gitlab")
    page = client.get(f"/admin/connections/connection/{mine.pk}/change/")
    assert page.status_code == 200
    assert 'name="credential"' not in page.content.decode()
    theirs = Connection.objects.get(name="theirs")
    assert client.get(f"/admin/connections/connection/{theirs.pk}/change/").status_code in (
        302,
        404,
    )
    assert client.get("/admin/connections/connection/add/").status_code == 403


def test_the_admin_refuses_to_delete_a_connection_a_grant_names(client, alice, acme):
    connection = gitlab(acme)
    agents.create_agent(
        acme, "Builder", credential_grants=[{"connection": "gitlab", "repositories": ["a/b"]}]
    )
    client.force_login(alice)
    answer = client.get(f"/admin/connections/connection/{connection.pk}/delete/", follow=True)
    assert "named by the grants of builder" in answer.content.decode()
    assert Connection.objects.exists()


def test_the_admin_refuses_renaming_a_granted_connection_on_the_form(client, alice, acme):
    connection = gitlab(acme)
    agents.create_agent(
        acme, "Builder", credential_grants=[{"connection": "gitlab", "repositories": ["a/b"]}]
    )
    client.force_login(alice)
    form = {"organisation": acme.pk, "name": "renamed", "kind": "token", "paths": "[]",
            "git_url": "https://gitlab.example", "scheme": "bearer"}  # fmt: skip
    answer = client.post(f"/admin/connections/connection/{connection.pk}/change/", form)
    assert answer.status_code == 200  # the form again, not "changed successfully"
    assert "grants name it (builder): change those first" in answer.content.decode()
    assert Connection.objects.get().name == "gitlab"
    assert connection.history.count() == 1  # nothing recorded as changed


def test_a_typed_credential_is_never_sent_back_with_the_form(client, alice, acme):
    client.force_login(alice)
    answer = client.post(
        "/admin/connections/connection/add/",
        {"organisation": acme.pk, "name": "gitlab", "kind": "token", "paths": "[]",
         "git_url": "http://gitlab.example", "scheme": "bearer", "credential": TOKEN},
    )  # fmt: skip
    assert "https only" in answer.content.decode()
    assert TOKEN not in answer.content.decode()
