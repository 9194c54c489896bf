"""The thirteen shipped templates: exact hosts, installed by migration, editable, restorable."""

import pytest

from allowlists.entries import parse_entry
from templates import services
from templates.catalogue import SHIPPED
from templates.models import AllowlistTemplate

SLUGS = [
    "github",
    "npm",
    "pypi",
    "go",
    "rust",
    "composer",
    "maven-gradle",
    "container",
    "debian-ubuntu",
    "rubygems",
    "nuget-dotnet",
    "alpine-rpm",
    "llm-apis",
]


def test_covey_ships_the_thirteen_templates():
    assert [t.slug for t in SHIPPED] == SLUGS


@pytest.mark.parametrize("template", SHIPPED, ids=lambda t: t.slug)
def test_every_shipped_entry_is_exact_and_already_normalised(template):
    assert template.name and template.description and template.docs.startswith("https://")
    assert template.entries, "a template with no hosts is useless"
    assert len(set(template.entries)) == len(template.entries)
    for text in template.entries:
        assert str(parse_entry(text)) == text


def test_apt_can_use_plain_http_through_the_debian_template():
    debian = next(t for t in SHIPPED if t.slug == "debian-ubuntu")
    plain = {parse_entry(text).host for text in debian.entries if parse_entry(text).port == 80}
    # Every apt host is reachable on port 80, the only port plain HTTP is allowed to.
    assert len(plain) >= 4


@pytest.mark.django_db
def test_the_migration_installed_every_template_as_shipped():
    installed = {t.slug: t for t in AllowlistTemplate.objects.all()}
    assert sorted(installed) == sorted(SLUGS)
    for shipped in SHIPPED:
        template = installed[shipped.slug]
        assert template.entries == template.shipped_entries
        assert sorted(template.entries) == sorted(shipped.entries)
        assert not template.is_modified


@pytest.mark.django_db
def test_an_installation_can_point_a_template_at_its_mirror_and_restore_it(api, root):
    client = api(root)
    response = client.patch(
        "/api/v1/allowlist-templates/pypi/", {"entries": ["PyPI.Mirror.Corp"]}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["entries"] == ["pypi.mirror.corp"]
    assert response.json()["modified"] is True
    # Re-installing (an upgrade's migration) keeps the installation's edit.
    assert services.install_shipped() == 0
    assert AllowlistTemplate.objects.get(slug="pypi").entries == ["pypi.mirror.corp"]
    restored = client.post("/api/v1/allowlist-templates/pypi/restore/").json()
    assert restored["modified"] is False
    assert restored["entries"] == restored["shipped_entries"]


@pytest.mark.django_db
def test_template_edits_are_recorded_with_who_made_them(operator_client, root):
    from django.urls import reverse

    template = AllowlistTemplate.objects.get(slug="npm")
    response = operator_client.post(
        reverse("admin:templates_allowlisttemplate_change", args=[template.pk]),
        {
            "name": template.name,
            "description": template.description,
            "docs_url": template.docs_url,
            "entries": "npm.mirror.corp",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    record = template.history.first()
    assert (record.history_user, record.entries) == (root, ["npm.mirror.corp"])
    operator_client.post(
        reverse("admin:templates_allowlisttemplate_changelist"),
        {"action": "restore_shipped", "_selected_action": [template.pk]},
    )
    template.refresh_from_db()
    assert not template.is_modified


@pytest.mark.django_db
def test_only_the_platform_team_changes_templates(api, alice):
    assert api(alice).get("/api/v1/allowlist-templates/npm/").status_code == 200
    response = api(alice).patch(
        "/api/v1/allowlist-templates/npm/", {"entries": ["evil.example"]}, format="json"
    )
    assert response.status_code == 403
    assert api(alice).post("/api/v1/allowlist-templates/npm/restore/").status_code == 403


@pytest.mark.django_db
def test_a_bad_template_entry_is_refused(api, root):
    response = api(root).patch(
        "/api/v1/allowlist-templates/npm/", {"entries": ["registry.example:0"]}, format="json"
    )
    assert response.status_code == 400
    assert "port" in str(response.json()["entries"])


@pytest.mark.django_db
def test_the_template_list_shows_slug_name_and_entries(api, vera):
    results = api(vera).get("/api/v1/allowlist-templates/").json()["results"]
    assert sorted(r["slug"] for r in results) == sorted(SLUGS)
    assert {"slug", "name", "entries"} <= set(results[0])
