"""Organisations (the tenants), their members and roles, and the queryset that scopes rows to
what a user may see: tenancy in one place. Imports no other covey app."""

from typing import Any

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from rest_framework.authtoken.models import Token
from simple_history.models import HistoricalRecords

from allowlists.entries import normalise_entries
from allowlists.fields import AllowlistField


def default_base_allowlist() -> list[str]:
    """The base allowlist a new organisation starts with (COVEY_EGRESS_BASE_ALLOWLIST)."""
    return normalise_entries(settings.COVEY_EGRESS_BASE_ALLOWLIST)


class Role(models.TextChoices):
    """What a member may do in an organisation."""

    ADMIN = "admin", "Admin"  # changes the organisation, its agents and workplaces
    APPROVER = "approver", "Approver"  # decides requests; reads everything
    VIEWER = "viewer", "Viewer"  # reads everything


class OwnRequests(models.TextChoices):
    """Whether a person decides a request they filed on an agent's behalf (four eyes)."""

    SOLE = "sole", "Only when nobody else can (the only approver decides, and it is recorded)"
    NEVER = "never", "Never: somebody else decides"


class TenantQuerySet(models.QuerySet):
    """Rows owned by an organisation, scoped to what a user may see: tenancy in one place."""

    # The lookup from this model to Membership.user.
    membership_lookup = "organisation__memberships__user"

    def for_user(self, user: Any) -> Any:
        """The rows of the organisations the user belongs to (everything for a superuser)."""
        if user.is_superuser:
            return self
        if not user.is_authenticated:
            return self.none()
        return self.filter(**{self.membership_lookup: user})


class OrganisationQuerySet(TenantQuerySet):
    """Organisations, scoped to what a user may see."""

    membership_lookup = "memberships__user"


class Organisation(models.Model):
    """A tenant: its agents, runners and workplaces belong to it and to nobody else."""

    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=100, unique=True)
    base_allowlist = AllowlistField(
        default=default_base_allowlist,
        help_text="Hosts every agent of this organisation may reach. One entry per line.",
    )
    request_expiry_minutes = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="A pending request nobody decides is rejected (as expired) after this many"
        " minutes; empty: requests wait until someone decides.",
    )
    own_requests = models.CharField(
        "Deciding one's own filing",
        max_length=8,
        choices=OwnRequests.choices,
        default=OwnRequests.SOLE,
        help_text="A request a person filed on an agent's behalf is decided by somebody else"
        " when the organisation has another approver or admin. With no other, its only"
        " approver may decide it (the request records that they decided their own filing),"
        " unless this says never.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    history = HistoricalRecords()

    objects = OrganisationQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A user's role in one organisation."""

    organisation = models.ForeignKey(
        Organisation, on_delete=models.CASCADE, related_name="memberships"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    history = HistoricalRecords()

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["organisation_id", "user_id"]
        constraints = [
            models.UniqueConstraint(fields=["organisation", "user"], name="membership_unique_user")
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.role}) in {self.organisation}"


class ApiToken(Token):
    """A user's API token as the admin shows it: named by its user and its first characters,
    never by its key (DRF's token is named by its key, which the admin then writes in titles,
    breadcrumbs and its log of changes)."""

    class Meta:
        proxy = True
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.user}'s API token {self.key[:4]}…"


class Webhook(models.Model):
    """Where an organisation's events are posted (organisations/webhooks.py), signed with a
    secret only covey and the receiver know: shown once when made, kept encrypted
    (covey/crypto.py). The last delivery's outcome is kept for people to see."""

    organisation = models.OneToOneField(
        Organisation, on_delete=models.CASCADE, related_name="webhook"
    )
    url = models.URLField(max_length=500, help_text="Events are POSTed here as signed JSON.")
    secret = models.TextField(editable=False)  # encrypted
    created_at = models.DateTimeField(auto_now_add=True)
    secret_made_at = models.DateTimeField()
    last_delivery_at = models.DateTimeField(null=True, blank=True)
    last_delivery = models.CharField(max_length=300, blank=True)

    def __str__(self) -> str:
        return f"webhook of {self.organisation}"
