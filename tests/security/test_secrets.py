"""Secrets are shown once, when made, and never again: not in any later API answer, admin page
or history, nor in any line the web process writes (gunicorn's own and access lines included,
in JSON), however they are used or misused meanwhile. Every kind covey makes: a runner
registration token, a runner token, an egress credential, a webhook's signing secret, a model
key, an API token and a password."""

import re
import secrets

import httpx
import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token

from tests.egress.conftest import subprocess_database_url
from tests.factories import AgentFactory, server_user
from tests.processes import control_plane

pytestmark = [
    pytest.mark.e2e,  # a control plane of its own: among the first to run
    pytest.mark.suite("secrets"),
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

ADMIN_PAGES = [
    "admin:runners_registrationtoken_changelist",
    "admin:runners_runner_changelist",
    "admin:egress_egresstoken_changelist",
    "admin:budgets_modelkey_changelist",
    "admin:organisations_organisation_changelist",
    "admin:organisations_apitoken_changelist",
    "admin:auth_user_changelist",
]


def admin_pages(client: Client) -> list[str]:
    """Every list above, and each row's page and history page."""
    pages = []
    for name in ADMIN_PAGES:
        listed = client.get(reverse(name))
        assert listed.status_code == 200, name
        pages.append(listed.content.decode())
        base = reverse(name).removesuffix("/")
        for link in set(re.findall(rf'href="({re.escape(base)}/[^"/]+/change/)"', pages[-1])):
            row = client.get(link)
            history = client.get(link.replace("/change/", "/history/"))
            pages += [row.content.decode(), history.content.decode()]
    return pages


def api_answers(api: httpx.Client) -> list[str]:
    """Every list of the API the platform team reads, and every row in it."""
    answers = []
    for resource in (
        "organisations", "memberships", "agents", "runners", "egress-tokens", "runs",
        "requests", "budgets", "charges", "egress-decisions", "workplaces",
    ):  # fmt: skip
        listed = api.get(f"/api/v1/{resource}/")
        assert listed.status_code == 200, (resource, listed.text)
        answers.append(listed.text)
        for row in listed.json().get("results", []):
            key = row.get("id") or row.get("request_id")
            answers.append(api.get(f"/api/v1/{resource}/{key}/").text)
    return answers


def test_every_secret_is_shown_once_and_never_again(tmp_path, acme, root, cases):
    password = "pw-" + secrets.token_urlsafe(16)
    person = server_user("keeper", password, is_staff=True)
    api_token = Token.objects.create(user=root).key
    agent = AgentFactory(organisation=acme, name="Holder")
    admin = Client()
    admin.force_login(root)

    made = admin.post(
        reverse("admin:runners_registrationtoken_add"),
        {"organisation": acme.pk, "description": "secrets"},
        follow=True,
    ).content.decode()
    registration = re.search(r"covey-reg-[A-Za-z0-9_-]+", made).group(0)
    made = admin.post(
        reverse("admin:organisations_apitoken_add"), {"user": person.pk}, follow=True
    ).content.decode()
    admin_token = re.search(r"Authorization: Token …&#x27;\): ([0-9a-f]{40})", made).group(1)
    assert Token.objects.get(user=person).key == admin_token
    model_key = "sk-ant-" + secrets.token_urlsafe(24)
    admin.post(
        reverse("admin:budgets_modelkey_add"),
        {"organisation": acme.pk, "vendor": "anthropic", "key": model_key},
    )
    env = {
        "COVEY_LOG_FORMAT": "json",
        "COVEY_LOG_LEVEL": "DEBUG",
        "GUNICORN_CMD_ARGS": "--access-logfile -",
    }
    with control_plane(tmp_path, subprocess_database_url(), **env) as url:
        headers = {"Authorization": f"Token {api_token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            registered = httpx.post(
                f"{url}/api/v1/runners/register/",
                json={"registration_token": registration, "name": "keeper-1", "labels": []},
            ).json()
            runner_token = registered["token"]
            issued = api.post("/api/v1/egress-tokens/", json={"agent": agent.pk}).json()
            egress_secret = issued["credentials"].split(":", 1)[1]
            webhook = api.put(
                f"/api/v1/organisations/{acme.pk}/webhook/",
                json={"url": "https://hooks.example.test/covey", "new_secret": True},
            ).json()["secret"]
            # Each used, and misused: where a careless line would write it.
            runner = {"Authorization": f"Runner {runner_token}"}
            assert httpx.post(f"{url}/api/v1/runner/", json={}, headers=runner).status_code == 200
            misuses = (
                f"Token {egress_secret}", f"Token {runner_token}", f"Runner {api_token}",
                f"Token {model_key}", f"Bearer {webhook}", f"Token {registration}",
            )  # fmt: skip
            for misuse in misuses:
                refused = httpx.get(f"{url}/api/v1/agents/", headers={"Authorization": misuse})
                assert refused.status_code == 401, misuse
            again = httpx.post(
                f"{url}/api/v1/runners/register/",
                json={"registration_token": registration + "x", "name": "keeper-2", "labels": []},
            )
            assert again.status_code in (400, 403)
            login = httpx.Client(base_url=url, timeout=30)
            page = login.get("/admin/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            for attempt in (password, password + "-wrong"):
                login.post(
                    "/admin/login/",
                    data={"username": "keeper", "password": attempt, "csrfmiddlewaretoken": token},
                )
            answers = api_answers(api)
    pages = admin_pages(admin)
    written = "".join(p.read_text(errors="replace") for p in tmp_path.glob("control-plane-*.log"))
    assert "GET /api/v1/agents/" in written  # the access lines are there to search
    shown = {
        "registration token": registration,
        "runner token": runner_token,
        "egress credential": egress_secret,
        "webhook secret": webhook,
        "model key": model_key,
        "API token": api_token,
        "API token made in the admin": admin_token,
        "password": password,
    }
    found = []
    for kind, secret in shown.items():
        places = (("the log", [written]), ("an API answer", answers), ("an admin page", pages))
        for where, texts in places:
            cases.add()
            for text in texts:
                if secret in text:
                    at = text.index(secret)
                    found.append(f"the {kind} in {where}: …{text[max(0, at - 200) : at]}")
                    break
    assert found == []
