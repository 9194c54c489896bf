"""Runners: hosts that run sandboxes for one organisation, and how they register."""

from django.conf import settings
from django.db import models

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
    paused = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["organisation_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organisation", "name"], name="runner_unique_name")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.organisation})"
