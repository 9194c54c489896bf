"""Egress tokens (who an agent is to the proxy) and the decision log (what the proxy did)."""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from organisations.models import TenantQuerySet


class EgressTokenQuerySet(TenantQuerySet):
    """Tokens, scoped by their agent's organisation."""

    membership_lookup = "agent__organisation__memberships__user"

    def live(self) -> "EgressTokenQuerySet":
        """Tokens that are neither revoked nor expired now."""
        return self.filter(revoked_at__isnull=True, expires_at__gt=timezone.now())


class EgressToken(models.Model):
    """A short-lived credential an agent shows the proxy; only its SHA-256 is stored."""

    agent = models.ForeignKey("agents.Agent", on_delete=models.CASCADE, related_name="tokens")
    sha256 = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(
        max_length=8, editable=False, help_text="The token's first characters, to recognise it."
    )
    purpose = models.CharField(max_length=100, blank=True, help_text="e.g. 'run 42' or 'manual'.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    objects = EgressTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["agent", "revoked_at", "expires_at"])]

    def __str__(self) -> str:
        return f"{self.prefix}… for {self.agent}"

    @property
    def is_live(self) -> bool:
        """Neither revoked nor expired."""
        return self.revoked_at is None and self.expires_at > timezone.now()


class DecisionQuerySet(TenantQuerySet):
    """Decisions, scoped by their agent's organisation (unidentified ones: superusers only)."""

    membership_lookup = "agent__organisation__memberships__user"


class Decision(models.Model):
    """One allow or deny of the egress proxy. Written in batches, never edited by people.

    Tunnels get their byte counts and ``closed_at`` when they close.
    """

    class Kind(models.TextChoices):
        CONNECT = "connect", "CONNECT tunnel"
        HTTP = "http", "plain HTTP request"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent = models.ForeignKey(
        "agents.Agent",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="egress_decisions",
    )
    username = models.CharField(max_length=200, blank=True, help_text="As the client sent it.")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    host = models.CharField(max_length=255)
    port = models.PositiveIntegerField()
    address = models.GenericIPAddressField(null=True, blank=True, help_text="The vetted address.")
    allowed = models.BooleanField()
    reason = models.CharField(max_length=32, help_text="'allowed' or the deny code.")
    detail = models.TextField(blank=True, help_text="Matching list sources, or what was wrong.")
    bytes_up = models.BigIntegerField(null=True, blank=True)
    bytes_down = models.BigIntegerField(null=True, blank=True)
    decided_at = models.DateTimeField(db_index=True)
    closed_at = models.DateTimeField(null=True, blank=True)
    proxy = models.CharField(max_length=100, blank=True, help_text="Which proxy decided.")

    objects = DecisionQuerySet.as_manager()

    class Meta:
        ordering = ["-decided_at"]
        indexes = [
            models.Index(fields=["agent", "-decided_at"]),
            models.Index(fields=["reason", "-decided_at"]),
        ]

    def __str__(self) -> str:
        verdict = "allow" if self.allowed else f"deny ({self.reason})"
        return f"{verdict} {self.host}:{self.port}"


class ProxySessionQuerySet(TenantQuerySet):
    """Proxy sessions, scoped by the organisation whose runner ran the proxy (the control
    plane's own proxies: superusers only)."""


class ProxySession(models.Model):
    """One life of an egress proxy process, from its start to its stop, and how much of what it
    decided reached the log: the log never has a gap it does not admit.

    The proxy numbers its decisions. A clean stop says how many it made; one that ends without
    (killed, crashed, its last batches unwritten) is found out when the same proxy starts
    again, and what it decided after its last recorded decision is then admitted as unknown.
    """

    class End(models.TextChoices):
        RUNNING = "running", "running"
        STOPPED = "stopped", "stopped cleanly"
        LOST = "lost", "ended without a clean stop"

    boot = models.CharField(max_length=32, unique=True, help_text="The process's own random id.")
    proxy = models.CharField(max_length=100, help_text="Which proxy (as in the decision log).")
    organisation = models.ForeignKey(
        "organisations.Organisation",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        help_text="Whose runner ran it (empty: the control plane's own proxy).",
    )
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    end = models.CharField(max_length=8, choices=End.choices, default=End.RUNNING)
    made = models.PositiveBigIntegerField(
        default=0, help_text="Decisions it made, as far as it said (all of them once stopped)."
    )
    recorded = models.PositiveBigIntegerField(default=0, help_text="Of those, in the log.")

    objects = ProxySessionQuerySet.as_manager()

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["proxy", "organisation", "end"])]

    def __str__(self) -> str:
        return f"{self.proxy} from {self.started_at:%Y-%m-%d %H:%M:%S}"

    @property
    def missing(self) -> int:
        """Decisions it said it made that are not in the log (dropped, or never written)."""
        return max(0, self.made - self.recorded)

    @property
    def gap(self) -> str:
        """What the log lacks of this proxy's decisions, in words ('' when nothing)."""
        said = []
        if self.missing:
            said.append(f"{self.missing} of its {self.made} decisions are not in the log")
        if self.end == self.End.LOST:
            said.append(
                f"it ended without a clean stop: any decisions after no. {self.made} are unknown"
                if self.made
                else "it ended without a clean stop: any decisions it made are unknown"
            )
        return "; ".join(said)
