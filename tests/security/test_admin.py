"""The admin against the usual attacks on a web admin: a forged POST (CSRF) is refused, no page
may be framed (clickjacking), `check --deploy` is clean with production settings and the
session and CSRF cookies are then Secure and the session's HttpOnly, and nothing an agent or a
member can name (an agent, an organisation, a request's reason, a run's task, a file name in a
home, a home change's path) reaches a page as markup."""

import os
import secrets
import subprocess
import time

import pytest
from cryptography.fernet import Fernet
from django.test import Client
from django.urls import reverse

from agents import services as agent_services
from approvals import services as approvals
from homes import services as homes
from homes.models import HomeChange
from runners.protocol import HomeAnswer, HomeEntry, HomeOp
from runs import services as runs
from tests.egress.conftest import subprocess_database_url
from tests.factories import online_runner
from tests.processes import ROOT, VENV_BIN

pytestmark = [pytest.mark.suite("admin"), pytest.mark.django_db]

XSS = '<script>alert("covey")</script><img src=x onerror=alert(1)>'
ESCAPED = "&lt;script&gt;alert(&quot;covey&quot;)&lt;/script&gt;"


@pytest.fixture
def operator(root) -> Client:
    client = Client()
    client.force_login(root)
    return client


def test_a_forged_post_is_refused(root, acme, cases):
    forger = Client(enforce_csrf_checks=True)
    forger.force_login(root)
    for name, data in (
        ("admin:agents_agent_add", {"organisation": acme.pk, "name": "forged"}),
        ("admin:organisations_organisation_add", {"name": "Forged", "slug": "forged"}),
        ("admin:logout", {}),
    ):
        cases.add()
        assert forger.post(reverse(name), data).status_code == 403, name


def test_no_page_may_be_framed(operator, client, cases):
    for url in (reverse("admin:index"), reverse("admin:login"), "/api/v1/agents/", "/healthz"):
        cases.add()
        response = (operator if "admin" in url else client).get(url)
        assert response.headers.get("X-Frame-Options") == "DENY", url


@pytest.mark.postgres
def test_check_deploy_is_clean_with_production_settings_and_cookies_are_then_secure(cases):
    production = {
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "COVEY_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
        "DJANGO_ALLOWED_HOSTS": "covey.example.test",
        "DATABASE_URL": subprocess_database_url(),
        "CELERY_BROKER_URL": "redis://covey.example.test:6379/0",
        "DJANGO_HTTPS": "true",
        "DJANGO_SECURE_SSL_REDIRECT": "true",
        "DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
        "DJANGO_SECURE_HSTS_PRELOAD": "true",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "COVEY_"))}
    checked = subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env | production, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    cases.add()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "System check identified no issues" in checked.stdout, checked.stdout
    served = subprocess.run(
        [str(VENV_BIN / "python"), "-c", COOKIES],
        cwd=ROOT, env=env | production, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    cases.add()
    assert served.returncode == 0, served.stdout + served.stderr
    cookies = dict(line.split("=", 1) for line in served.stdout.split())
    assert cookies == {"csrftoken": "Secure", "sessionid": "HttpOnly,Secure"}, served.stdout


# The login page and a login, over HTTPS, in a process with the production settings: which
# flags each cookie it sets carries.
COOKIES = """
import django, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")
django.setup()
from django.test import Client
from django.test.utils import setup_test_environment
setup_test_environment()
client = Client(HTTP_HOST="covey.example.test")
page = client.get("/admin/login/", secure=True)
flags = {}
for name, morsel in page.cookies.items():
    flags[name] = [f for f in ("HttpOnly", "Secure") if morsel[f.lower()]]
from django.contrib.sessions.backends.db import SessionStore
session = SessionStore()
session["x"] = 1
session.save()
from django.http import HttpResponse
from django.contrib.sessions.middleware import SessionMiddleware
from django.test import RequestFactory
request = RequestFactory().get("/", secure=True)
request.session = session
response = SessionMiddleware(lambda r: HttpResponse()).process_response(request, HttpResponse())
for name, morsel in response.cookies.items():
    flags[name] = [f for f in ("HttpOnly", "Secure") if morsel[f.lower()]]
print(" ".join(f"{name}={','.join(sorted(f))}" for name, f in sorted(flags.items())))
"""


def test_what_agents_and_members_name_never_reaches_a_page_as_markup(
    operator, acme, alice, monkeypatch, cases
):
    agent = agent_services.create_agent(acme, XSS, allowlist=["a.example"])
    acme.name = f"Acme {XSS}"
    acme.save()
    runner, _ = online_runner(acme)
    agent.home_runner = runner
    agent.save()
    approvals.file_egress(agent, "b.example", reason=XSS, by=alice)
    run = runs.queue_run(agent, XSS)
    HomeChange.objects.create(
        agent=agent, by=alice, by_name=XSS, operation=HomeOp.WRITE, path=XSS, bytes=1
    )
    entry = HomeEntry(XSS, "file", 3, time.time())
    monkeypatch.setattr(homes, "ask", lambda *a, **k: HomeAnswer(entries=(entry,), total=1))
    pages = [
        reverse("admin:index"),
        reverse("admin:agents_agent_changelist"),
        reverse("admin:agents_agent_change", args=[agent.pk]),
        reverse("admin:organisations_organisation_change", args=[acme.pk]),
        reverse("admin:approvals_request_changelist"),
        reverse("admin:runs_run_changelist"),
        reverse("admin:runs_run_change", args=[run.pk]),
        reverse("admin:homes_home_change", args=[agent.pk]),
        reverse("admin:homes_homechange_changelist"),
    ]
    shown = []
    for url in pages:
        cases.add()
        response = operator.get(url, follow=True)
        assert response.status_code == 200, url
        text = response.content.decode()
        assert "<script>alert(" not in text and "<img src=x onerror" not in text, url
        shown.append(ESCAPED in text)
    assert all(shown[1:3]) and shown[-2], shown  # the payload is there, as text
