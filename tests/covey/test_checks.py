"""System checks stop start-up on settings that make no sense (egress, and what every process
shares), and `check --deploy` on what a deployment must give."""

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from covey.checks import check_deployment, check_hosts
from egress.checks import check_egress_settings


def ids(**settings):
    with override_settings(**settings):
        return [message.id for message in check_egress_settings()]


def test_the_defaults_pass():
    assert ids() == []


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"COVEY_EGRESS_BASE_ALLOWLIST": ["*.anthropic.com"]}, "egress.E001"),
        ({"COVEY_EGRESS_BASE_ALLOWLIST": ["10.0.0.1"]}, "egress.E001"),
        ({"COVEY_EGRESS_ISOLATION": "strict"}, "egress.E002"),
        ({"COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": ["10.0.0.1/8"]}, "egress.E003"),
        ({"COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": ["mirror.corp"]}, "egress.E003"),
        ({"COVEY_EGRESS_NAMESERVERS": ["dns.example"]}, "egress.E004"),
        # A proxy that polls less often than it trusts its policy refuses all between polls.
        ({"COVEY_EGRESS_POLICY_POLL": 60, "COVEY_EGRESS_POLICY_GRACE": 15}, "egress.E005"),
        ({"COVEY_EGRESS_POLICY_POLL": 10, "COVEY_EGRESS_POLICY_GRACE": 15}, "egress.E005"),
        ({"COVEY_EGRESS_POLICY_POLL": 0}, "egress.E005"),
        ({"COVEY_EGRESS_POLICY_POLL": float("nan")}, "egress.E005"),
    ],
)
def test_bad_egress_settings_are_errors_with_ids(settings, expected):
    assert ids(**settings) == [expected]


def test_good_egress_settings_pass():
    assert (
        ids(
            COVEY_EGRESS_ISOLATION="network",
            COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS=["10.20.0.0/16", "fd00::/8"],
            COVEY_EGRESS_NAMESERVERS=["127.0.0.53", "::1@5353"],
        )
        == []
    )


# --- covey/checks.py: the settings every process shares, and a deployment's ----------------

GIVEN = {"DJANGO_SECRET_KEY": "given", "COVEY_ENCRYPTION_KEYS": "given"}


def deploy_ids(monkeypatch, environ=GIVEN, engine="django.db.backends.postgresql", **settings):
    for name in ("DJANGO_SECRET_KEY", "COVEY_ENCRYPTION_KEYS"):
        if name in environ:
            monkeypatch.setenv(name, environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(django_settings.DATABASES["default"], "ENGINE", engine)
    settings = {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/0", "DEBUG": False, **settings}
    with override_settings(**settings):
        return sorted(message.id for message in check_deployment())


def test_a_deployment_with_what_it_needs_passes(monkeypatch):
    assert deploy_ids(monkeypatch) == []


@pytest.mark.parametrize(
    ("environ", "settings", "expected"),
    [
        ({}, {}, ["covey.E002", "covey.E003"]),
        ({"COVEY_ENCRYPTION_KEYS": "given"}, {}, ["covey.E002"]),
        (GIVEN, {"DEBUG": True}, ["covey.E004"]),
        (GIVEN, {"ALLOWED_HOSTS": ["*"]}, ["covey.W001"]),
        (GIVEN, {"CELERY_BROKER_URL": "filesystem://"}, ["covey.W003"]),
    ],
)
def test_what_make_run_makes_for_itself_a_deployment_must_give(
    monkeypatch, environ, settings, expected
):
    assert deploy_ids(monkeypatch, environ, **settings) == expected


def test_a_deployment_on_sqlite_is_warned(monkeypatch):
    assert deploy_ids(monkeypatch, engine="django.db.backends.sqlite3") == ["covey.W002"]


def test_no_allowed_host_is_an_error_at_every_start():
    with override_settings(ALLOWED_HOSTS=[], DEBUG=False):
        (error,) = check_hosts()
    assert error.id == "covey.E001" and "every request would be refused" in error.msg
    with override_settings(ALLOWED_HOSTS=["covey.example.test"]):
        assert check_hosts() == []


def test_the_deployment_checks_run_with_check_deploy_and_stop_on_an_error(monkeypatch):
    monkeypatch.delenv("DJANGO_SECRET_KEY", raising=False)
    with pytest.raises(SystemCheckError, match=r"covey\.E002"):
        call_command("check", deploy=True, tags=["covey"], fail_level="ERROR")
