"""System checks of the settings every covey process shares, by the "covey" tag.

Every command that runs checks (migrate, runserver, check) stops on an error here. Those
registered for deployment run with ``manage.py check --deploy`` and whenever the control-plane
image's web role starts (covey/entrypoint.py): what is fine on a laptop under `make run` but
loses data, sessions or secrets once several processes or hosts share one installation.
"""

import os
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register


@register("covey")
def check_hosts(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """With no host name allowed, every request is refused (400)."""
    if settings.ALLOWED_HOSTS or settings.DEBUG:
        return []
    return [
        Error(
            "DJANGO_ALLOWED_HOSTS is empty: every request would be refused (400 Bad Request).",
            hint="List the names people and runners use to reach covey, comma-separated"
            " (e.g. covey.example.com,127.0.0.1).",
            id="covey.E001",
        )
    ]


@register("covey", deploy=True)
def check_deployment(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What a deployment must give and `make run` makes for itself."""
    messages: list[CheckMessage] = []
    for name, what in (
        ("DJANGO_SECRET_KEY", "sessions"),
        ("COVEY_ENCRYPTION_KEYS", "the model keys and webhook secrets stored encrypted"),
    ):
        if not os.environ.get(name):
            messages.append(
                Error(
                    f"{name} is not set: the key in use is a file this host made under"
                    f" {settings.VAR_DIR}, which other processes and hosts do not share and"
                    f" which goes with this host ({what} depend on it).",
                    hint=f"Set {name} for every process (scripts/compose-env makes one), and"
                    " back it up with the database.",
                    id="covey.E002" if name == "DJANGO_SECRET_KEY" else "covey.E003",
                )
            )
    if settings.DEBUG:
        messages.append(
            Error(
                "DJANGO_DEBUG is on: error pages show settings, code and queries to whoever"
                " causes one.",
                hint="Unset DJANGO_DEBUG (it is off by default).",
                id="covey.E004",
            )
        )
    if "*" in settings.ALLOWED_HOSTS:
        messages.append(
            Warning(
                "DJANGO_ALLOWED_HOSTS has '*': any Host header is taken, including in the links"
                " covey makes (password resets, the URLs it prints).",
                hint="List the names covey is reached by.",
                id="covey.W001",
            )
        )
    if settings.DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
        messages.append(
            Warning(
                "The database is SQLite (DATABASE_URL is unset or sqlite://): one file on this"
                " host (make run's), which backups and concurrent writers do not suit.",
                hint="Point DATABASE_URL at PostgreSQL (postgres://user:password@host/db).",
                id="covey.W002",
            )
        )
    if settings.CELERY_BROKER_URL.startswith("filesystem:"):
        messages.append(
            Warning(
                "The broker is files on this host (CELERY_BROKER_URL is unset or filesystem://,"
                " make run's): no runner on another host can take its orders.",
                hint="Point CELERY_BROKER_URL at Redis (redis://:password@host:6379/0).",
                id="covey.W003",
            )
        )
    return messages
