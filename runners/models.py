"""Runners: hosts that run sandboxes for one organisation, and how they register."""

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from agents.models import TenantQuerySet


class RegistrationToken(models.Model):
    """A secret an operator hands to a new runner host so it can register; stored hashed."""

    organisation = models.ForeignKey(
        "agents.Organisation", on_delete=models.CASCADE, related_name="registration_tokens"
    )
    description = models.CharField(max_length=200, blank=True)
    sha256 = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=8, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.organisation})"


class Runner(models.Model):
    """A host that runs sandboxes for exactly one organisation. It never touches the database:
    it takes orders from its Celery queue and talks to the API with its runner token."""

    organisation = models.ForeignKey(
        "agents.Organisation", on_delete=models.PROTECT, related_name="runners"
    )
    name = models.CharField(max_length=100)
    labels = models.JSONField(default=list, blank=True)
    token_sha256 = models.CharField(max_length=64, unique=True, editable=False)
    token_prefix = models.CharField(max_length=8, editable=False)
    paused = models.BooleanField(
        default=False, help_text="A paused runner finishes what runs and accepts nothing new."
    )
    builtin = models.BooleanField(
        default=False, editable=False, help_text="The control-plane host's own runner."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    token_renewed_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["organisation_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organisation", "name"], name="runner_unique_name")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.organisation})"

    @property
    def queue(self) -> str:
        """The Celery queue its orders go to (the built-in runners share one host)."""
        return BUILTIN_QUEUE if self.builtin else f"runner.{self.pk}"

    @property
    def online(self) -> bool:
        """It has sent a heartbeat recently (COVEY_RUNNER_STALE_SECONDS)."""
        return self.last_seen_at is not None and self.last_seen_at >= stale_before()


BUILTIN_QUEUE = "runners.builtin"


def stale_before() -> datetime:
    """Runners last seen before this are stale (offline)."""
    return timezone.now() - timedelta(seconds=settings.COVEY_RUNNER_STALE_SECONDS)
