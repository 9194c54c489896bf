"""Workplaces: what they may hold (checked), versioning and differences, the API and the admin,
and what a run takes from the workplace version it was queued at."""

import pytest
from django.core.exceptions import ValidationError

from runs.services import queue_run, sandbox_spec
from tests.factories import AgentFactory, WorkplaceFactory
from workplaces import config
from workplaces.models import Workplace, WorkplaceVersion
from workplaces.services import create_workplace, update_workplace

DB = {
    "name": "db",
    "image": "postgres:16",
    "environment": {"POSTGRES_PASSWORD": "test"},
    "ready": {"command": ["pg_isready"], "timeout": 30},
}


# --- what a workplace may hold -----------------------------------------------------------------


def test_packages_are_normalised_sorted_and_deduplicated():
    found = config.check_packages({"apt": [" jq", "hello=2.10-3", "jq", "build-essential"]})
    assert found == {"apt": ["build-essential", "hello=2.10-3", "jq"]}
    assert config.check_packages({"apt": []}) == {}
    assert config.check_packages(None) == {}


def test_pip_and_npm_packages_are_normalised_in_the_installers_own_grammar():
    found = config.check_packages(
        {
            "npm": ["left-pad", "@types/node@^20", "semver@>=7.0.0 <8"],
            "pip": ["Requests[socks,Brotli]>=2,<3", "foo_bar==1.0", "pyyaml"],
        }
    )
    # Ecosystems in the order they are installed; pip names canonical, extras sorted.
    assert list(found) == ["pip", "npm"]
    assert found["pip"] == ["foo-bar==1.0", "pyyaml", "requests[brotli,socks]<3,>=2"]
    assert found["npm"] == ["@types/node@^20", "left-pad", "semver@>=7.0.0 <8"]
    assert config.package_name("pip", "requests[socks]<3,>=2") == "requests"
    assert config.package_name("npm", "@types/node@^20") == "@types/node"
    assert config.package_name("apt", "hello=2.10-3") == "hello"
    assert config.is_bare("npm", "@types/node") and not config.is_bare("npm", "@types/node@1")
    assert config.is_bare("pip", "pyyaml") and not config.is_bare("pip", "pyyaml>=6")


@pytest.mark.parametrize(
    ("packages", "message"),
    [
        ({"cargo": ["serde"]}, "'cargo' is not an ecosystem covey installs"),
        ({"apt": "jq"}, "apt: give a list of package names"),
        ({"apt": ["-o=Dpkg::Options"]}, "is not a Debian package name"),
        ({"apt": ["jq; rm -rf /"]}, "is not a Debian package name"),
        ({"apt": ["Jq"]}, "is not a Debian package name"),
        ({"apt": ["sudo-"]}, "is not a Debian package name"),  # apt would remove it
        ({"apt": ["jq\nrm"]}, "is not a Debian package name"),
        ({"apt": ["jq=1.6 evil"]}, "is not a Debian version"),
        ({"apt": ["jq=1.6", "jq=1.7"]}, "jq given with two versions"),
        ({"pip": ["requests @ https://evil.example/r.whl"]}, "names a URL"),
        ({"pip": ["requests; sys_platform == 'linux'"]}, "has an environment marker"),
        ({"pip": ["--index-url=http://evil"]}, "is not a requirement"),
        ({"pip": ["-e ."]}, "is not a requirement"),
        ({"pip": ["requests==2 --pre"]}, "is not a requirement"),
        ({"pip": ["Requests==2", "requests==3"]}, "requests given with two versions"),
        ({"pip": ["foo===../../../tmp/build-me"]}, "is not a version specifier covey takes"),
        ({"pip": ["foo===1.0"]}, "is not a version specifier covey takes"),
        ({"npm": ["foo.tgz"]}, "names a file"),
        ({"npm": ["left-pad@left-pad-1.3.0.tar.gz"]}, "names a file"),
        ({"npm": ["~left-pad"]}, "is not a package name"),
        ({"npm": ["-left-pad"]}, "is not a package name"),
        ({"npm": ["left-pad@git+https://evil/x.git"]}, "is not a version, a range or a tag"),
        ({"npm": ["left-pad@file:../x"]}, "is not a version, a range or a tag"),
        ({"npm": ["pad@npm:left-pad"]}, "is not a version, a range or a tag"),
        ({"npm": ["left-pad@--ignore-scripts=false"]}, "is not a version, a range or a tag"),
        ({"npm": ["--registry=http://evil"]}, "is not a package name"),
        ({"npm": ["Left-Pad"]}, "is not a package name"),
        ({"npm": ["./x"]}, "is not a package name"),
        ({"npm": ["left-pad@1", "left-pad@2"]}, "left-pad given with two versions"),
        (["jq"], "Give packages as"),
    ],
)
def test_bad_packages_are_refused_saying_what_is_wrong(packages, message):
    with pytest.raises(ValueError, match=message):
        config.check_packages(packages)


def test_a_service_gets_every_key_with_defaults():
    (db,) = config.check_services([DB])
    assert db == {
        "name": "db",
        "image": "postgres:16",
        "environment": {"POSTGRES_PASSWORD": "test"},
        "command": [],
        "ready": {"command": ["pg_isready"], "start_period": 0.0, "interval": 1.0, "timeout": 30.0},
        "cpus": 1.0,
        "memory_mb": 512,
    }
    assert config.check_services([{"name": "cache", "image": "redis:7"}])[0]["ready"] is None


@pytest.mark.parametrize(
    ("services", "message"),
    [
        ({"name": "db"}, "give services as a JSON list"),
        ([{**DB, "name": "DB"}], "one DNS label"),
        ([{**DB, "name": "db.internal"}], "one DNS label"),
        ([{**DB, "name": "db\n"}], "one DNS label"),
        ([{**DB, "image": "postgres:16\n"}], "is not an image reference"),
        ([{**DB, "name": "localhost"}], "the name localhost is reserved"),
        ([DB, DB], "two services are named db"),
        ([{**DB, "image": "http://evil/x"}], "service db: 'http://evil/x' is not an image"),
        ([{**DB, "ports": [5432]}], "service 1: unknown keys ports"),
        ([{**DB, "environment": {"A B": "x"}}], "'A B' is not an environment variable name"),
        ([{**DB, "environment": {"A": 1}}], "A must be text"),
        ([{**DB, "command": "postgres -c x"}], "service db: command: give a JSON list"),
        ([{**DB, "ready": {"command": []}}], "readiness command: give a command"),
        ([{**DB, "ready": {"command": ["x"], "timeout": 0}}], "timeout must be a number from 1"),
        ([{**DB, "ready": {"command": ["x"], "retries": 3}}], "unknown readiness keys retries"),
        ([{**DB, "memory_mb": 8}], "memory_mb must be a number from 16"),
        ([{**DB, "cpus": True}], "cpus must be a number"),
        ([{**DB, "name": f"s{i}"} for i in range(9)], "at most 8 services"),
    ],
)
def test_bad_services_are_refused_saying_what_is_wrong(services, message):
    with pytest.raises(ValueError, match=message):
        config.check_services(services)


# --- versions ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_every_change_is_a_new_version_recording_who_and_what(acme, alice):
    workplace = create_workplace(acme, "dev", "covey-base:trixie", by=alice)
    assert workplace.version == 1
    update_workplace(workplace, by=alice, packages={"apt": ["jq"]}, services=[DB])
    update_workplace(workplace, by=alice, packages={"apt": ["jq"]})  # nothing changes
    assert workplace.version == 2
    latest = workplace.versions.get(number=2)
    assert latest.created_by == alice
    assert latest.changes["packages"] == [{}, {"apt": ["jq"]}]
    assert latest.changes["services"][0] == []
    assert latest.config["services"][0]["ready"]["interval"] == 1.0  # as checked, defaults in
    assert sorted(latest.changes) == ["packages", "services"]


@pytest.mark.django_db
def test_a_bad_change_leaves_the_workplace_and_its_versions_as_they_were(acme):
    workplace = create_workplace(acme, "dev", "covey-base:trixie", packages={"apt": ["jq"]})
    with pytest.raises(ValidationError) as refused:
        update_workplace(workplace, image="UPPER/case", services=[{"name": "x"}])
    assert set(refused.value.message_dict) == {"image", "services"}  # everything wrong
    with pytest.raises(ValidationError) as refused:
        update_workplace(workplace, image="UPPER/case")
    assert "image" in refused.value.message_dict
    workplace.refresh_from_db()
    assert (workplace.version, workplace.image, workplace.services) == (1, "covey-base:trixie", [])
    assert WorkplaceVersion.objects.filter(workplace=workplace).count() == 1


@pytest.mark.django_db
def test_names_are_unique_within_an_organisation(acme, globex):
    create_workplace(acme, "dev", "covey-base:trixie")
    create_workplace(globex, "dev", "covey-base:trixie")
    with pytest.raises(ValidationError, match="a workplace named 'dev' exists already"):
        create_workplace(acme, "dev", "covey-base:trixie")


# --- the API -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_api_creates_changes_lists_versions_and_compares(api, alice, acme):
    client = api(alice)
    created = client.post(
        "/api/v1/workplaces/",
        {"organisation": acme.pk, "name": "dev", "image": "covey-base:trixie"},
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["version"], body["packages"], body["services"]) == (1, {}, [])
    url = f"/api/v1/workplaces/{body['id']}/"
    changed = client.patch(url, {"packages": {"apt": ["jq"]}, "services": [DB]}, format="json")
    assert changed.status_code == 200, changed.content
    assert changed.json()["version"] == 2
    assert changed.json()["services"][0]["ready"]["start_period"] == 0.0
    versions = client.get(f"{url}versions/").json()["results"]
    assert [(v["number"], v["created_by"]) for v in versions] == [(2, "alice"), (1, "alice")]
    compared = client.get(f"{url}compare/?from=1&to=2").json()
    assert compared["changes"]["packages"] == [{}, {"apt": ["jq"]}]
    assert client.get(f"{url}compare/?from=1&to=7").status_code == 404
    assert client.get(f"{url}compare/?from=a&to=2").status_code == 400


@pytest.mark.django_db
def test_the_api_refuses_bad_services_with_a_field_message_and_keeps_the_workplace(
    api, alice, acme
):
    workplace = WorkplaceFactory(organisation=acme)
    response = api(alice).patch(
        f"/api/v1/workplaces/{workplace.pk}/",
        {"services": [{**DB, "name": "localhost"}], "description": "changed"},
        format="json",
    )
    assert response.status_code == 400
    assert response.json() == {"services": ["service localhost: the name localhost is reserved"]}
    workplace.refresh_from_db()
    assert (workplace.version, workplace.description) == (1, "")


@pytest.mark.django_db
def test_viewers_read_and_other_organisations_see_nothing(api, vera, gary, acme):
    workplace = WorkplaceFactory(organisation=acme)
    url = f"/api/v1/workplaces/{workplace.pk}/"
    assert api(vera).get(f"{url}versions/").status_code == 200
    assert api(vera).patch(url, {"description": "x"}, format="json").status_code == 403
    for suffix in ("", "versions/", "compare/?from=1&to=1"):
        assert api(gary).get(f"{url}{suffix}").status_code == 404
    assert Workplace.objects.get(pk=workplace.pk).version == 1


# --- what a run takes --------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_run_takes_the_workplace_version_it_was_queued_at(acme):
    workplace = create_workplace(
        acme,
        "dev",
        "covey-base:trixie",
        packages={"apt": ["jq"]},
        services=[DB],
        runtime_command=["make", "test"],
    )
    agent = AgentFactory(organisation=acme, workplace=workplace)
    run = queue_run(agent, "test it")
    update_workplace(workplace, packages={"apt": ["jq", "git"]}, services=[])  # after queueing
    assert run.workplace_version.number == 1
    spec = sandbox_spec(run, "u:t")
    assert spec.image == "covey-base:trixie"
    assert spec.command == ("make", "test")  # the workplace's, the agent has none
    assert [(p.ecosystem, p.specs) for p in spec.packages] == [("apt", ("jq",))]
    (db,) = spec.services
    assert (db.name, db.image, db.environment) == ("db", "postgres:16", ("POSTGRES_PASSWORD=test",))
    assert db.ready is not None and db.ready.command == ("pg_isready",)
    assert spec.workplace == "dev v1"
    second = sandbox_spec(queue_run(agent, "again"), "u:t")
    assert second.services == () and second.packages[0].specs == ("git", "jq")


@pytest.mark.django_db
def test_the_agents_own_command_wins_over_its_workplaces(acme):
    workplace = create_workplace(acme, "dev", "covey-base:trixie", runtime_command=["make"])
    agent = AgentFactory(organisation=acme, workplace=workplace, runtime_command=["true"])
    assert sandbox_spec(queue_run(agent, "x"), "u:t").command == ("true",)


@pytest.mark.django_db
def test_a_run_takes_the_newest_versions_even_from_an_agent_read_before_them(acme):
    workplace = create_workplace(acme, "dev", "covey-base:trixie")
    agent = AgentFactory(organisation=acme, workplace=workplace)
    assert agent.workplace.version == 1  # read now, cached on the instance
    update_workplace(Workplace.objects.get(pk=workplace.pk), packages={"apt": ["jq"]})
    run = queue_run(agent, "x")
    assert run.workplace_version.number == 2
    assert sandbox_spec(run, "u:t").packages[0].specs == ("jq",)
