"""Connections: an organisation's credential for an upstream (a git host, its API, a registry),
kept encrypted, used by the gateway for agents within their grants (docs/credentials.md)."""

from urllib.parse import urlsplit

from django.db import models
from simple_history.models import HistoricalRecords

from organisations.models import Organisation, TenantQuerySet


class Kind(models.TextChoices):
    """What the credential is, and so how the gateway uses it."""

    GITHUB_APP = "github-app", "GitHub App"
    TOKEN = "token", "Access token"
    BASIC = "basic", "User name and password (a registry or an HTTP API)"


class Scheme(models.TextChoices):
    """How a token is sent upstream."""

    BEARER = "bearer", "Authorization: Bearer <token>"
    BASIC = "basic", "Authorization: Basic <user name:token>"
    HEADER = "header", "A header of its own (e.g. PRIVATE-TOKEN)"


class Connection(models.Model):
    """A named upstream of an organisation with its credential. The credential (``secret``:
    a GitHub App's private key, a token, a password) is written once, never shown again, and
    kept encrypted (covey/crypto.py); change it by rotating (connections.services).

    Change a connection only through ``connections.services``, which checks each kind's
    fields and keeps the history (every change and rotation, by whom)."""

    organisation = models.ForeignKey(
        Organisation, on_delete=models.PROTECT, related_name="connections"
    )
    name = models.SlugField(
        max_length=50, help_text="How grants name it: lowercase letters, digits and '-'."
    )
    kind = models.CharField(max_length=20, choices=Kind.choices)
    git_url = models.URLField(
        "git URL",
        max_length=300,
        blank=True,
        help_text="Where its repositories are cloned from, e.g. https://github.com (https only).",
    )
    api_url = models.URLField(
        "API URL",
        max_length=300,
        blank=True,
        help_text="Its HTTP API, e.g. https://api.github.com (https only; empty: none).",
    )
    scheme = models.CharField(
        max_length=10,
        choices=Scheme.choices,
        blank=True,
        help_text="How a token is sent (tokens only).",
    )
    username = models.CharField(
        "user name", max_length=200, blank=True, help_text="For basic authentication."
    )
    header = models.CharField(
        max_length=100, blank=True, help_text="The header a token is sent in (scheme 'header')."
    )
    app_id = models.CharField("app id", max_length=20, blank=True, help_text="GitHub Apps only.")
    installation_id = models.CharField(
        "installation id",
        max_length=20,
        blank=True,
        help_text="The app's installation on the account that owns the repositories.",
    )
    index_url = models.URLField(
        "index URL",
        max_length=300,
        blank=True,
        help_text="A registry's or API's root, e.g. https://pypi.example.com (https only).",
    )
    paths = models.JSONField(
        default=list,
        blank=True,
        help_text='The paths under it the credential is for, e.g. ["/simple/", "/packages/"].',
    )
    secret = models.TextField(editable=False)  # encrypted (covey/crypto.py)
    secret_set_at = models.DateTimeField(editable=False)
    status = models.CharField(
        max_length=300,
        blank=True,
        editable=False,
        help_text="What the upstream last said of the credential, when it refused it.",
    )
    status_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()
    history = HistoricalRecords(excluded_fields=["secret", "status", "status_at", "updated_at"])

    class Meta:
        ordering = ["organisation_id", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["organisation", "name"], name="connection_unique_name_per_org"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.get_kind_display()})"

    @property
    def host(self) -> str:
        """The git host's name, with ``:port`` when not 443: what the gateway's git paths name
        (``/git/<host>/<owner>/<name>``); empty when it has no git URL."""
        return _host(self.git_url)

    @property
    def api_host(self) -> str:
        """The same of its API (``/api/<host>/repos/<owner>/<name>/…``); empty: no API."""
        return _host(self.api_url)


def _host(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # refused when saved (connections.services): it names no host
        return ""
    if not parts.hostname:
        return ""
    return parts.hostname + (f":{port}" if port not in (None, 443) else "")


# What people set on a connection, in the order forms show it (the credential apart: it is
# written, never read); changes go through connections.services.
CONNECTION_FIELDS = (
    "organisation",
    "name",
    "kind",
    "git_url",
    "api_url",
    "scheme",
    "username",
    "header",
    "app_id",
    "installation_id",
    "index_url",
    "paths",
)


class CredentialedRequest(models.Model):
    """One request a sandbox made through the gateway under a connection, or tried to: the
    record (written by the gateway, never changed). ``refused`` says why covey refused it, or
    why the upstream could not be used; a push lists each ref it would have moved."""

    organisation = models.ForeignKey(
        Organisation, on_delete=models.CASCADE, related_name="credentialed_requests"
    )
    agent = models.ForeignKey(
        "agents.Agent", on_delete=models.CASCADE, related_name="credentialed_requests"
    )
    run = models.ForeignKey(
        "runs.Run",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="credentialed_requests",
    )
    connection = models.ForeignKey(
        Connection,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="requests",
        help_text="Empty when no grant covered the request (or the connection is gone).",
    )
    at = models.DateTimeField(db_index=True)
    method = models.CharField(max_length=10)
    host = models.CharField(max_length=300)
    repository = models.CharField(max_length=201, help_text="owner/name")
    service = models.CharField(
        max_length=30,
        help_text="What was asked: git-upload-pack (fetch), git-receive-pack (push), api.",
    )
    path = models.CharField(
        max_length=1000, blank=True, help_text="An API call's path, at the API's root."
    )
    status = models.PositiveSmallIntegerField(help_text="What the sandbox was answered.")
    refused = models.CharField(
        max_length=1000,
        blank=True,
        help_text="Why covey refused it, or why the upstream could not be used (empty: passed).",
    )
    refs = models.JSONField(
        default=list,
        blank=True,
        help_text="A push's ref updates: ref, old and new object ids, and why one was refused.",
    )

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [
            models.Index(fields=["run", "at"], name="credreq_run_at"),
            models.Index(fields=["agent", "at"], name="credreq_agent_at"),
        ]

    def __str__(self) -> str:
        return f"{self.method} {self.host}/{self.repository} ({self.service})"
