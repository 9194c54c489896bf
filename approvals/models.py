"""Requests: an agent missing a package or a route asks; a person approves or rejects, and the
record stays (nothing here is ever deleted).

Change them only through ``approvals.services``, which checks who may decide and writes the
versions an approval produces.
"""

from django.conf import settings
from django.db import models

from organisations.models import TenantQuerySet


class Kind(models.TextChoices):
    PACKAGE = "package"  # ecosystem + name[=version]: added to the agent's workplace
    EGRESS = "egress"  # host[:port]: added to an allowlist


class Status(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"


class Scope(models.TextChoices):
    """Where an approved egress entry goes."""

    AGENT = "agent", "this agent (a new agent version)"
    WORKPLACE = "workplace", "every agent of its workplace (a new version of each)"
    ORGANISATION = "organisation", "the organisation's base list"


class Request(models.Model):
    """One thing asked for, by one or more requesters (duplicates are merged into it)."""

    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.PROTECT, related_name="requests"
    )
    agent = models.ForeignKey(
        "agents.Agent", on_delete=models.PROTECT, related_name="requests",
        help_text="The agent that asked first.",
    )  # fmt: skip
    workplace = models.ForeignKey(
        "workplaces.Workplace",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="requests",
        help_text="The agent's workplace when it asked (a package goes there).",
    )
    kind = models.CharField(max_length=8, choices=Kind.choices)
    ecosystem = models.CharField(max_length=16, blank=True)
    package = models.CharField(
        max_length=255,
        blank=True,
        help_text="As its installer takes it: apt name=1.2, pip name==1.2, npm name@1.2.",
    )
    target = models.CharField(max_length=300, blank=True, help_text="host:port, normalised")
    status = models.CharField(
        max_length=8, choices=Status.choices, default=Status.PENDING, db_index=True
    )
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    note = models.TextField(blank=True, help_text="Why it was decided so (or answered at once).")
    scope = models.CharField(max_length=12, choices=Scope.choices, blank=True)
    grant_expires_at = models.DateTimeField(
        null=True, blank=True, help_text="When an approved entry is removed again."
    )
    workplace_version = models.PositiveIntegerField(
        null=True, blank=True, help_text="The workplace's version when the request was filed."
    )
    decided_by_filer = models.BooleanField(
        default=False,
        help_text="Decided by the person who filed it, the only approver its organisation had"
        " (its 'Deciding one's own filing' setting allows that).",
    )
    produced = models.JSONField(
        default=dict,
        blank=True,
        help_text="What the decision changed: agent versions, a workplace version, the base list.",
    )
    expired = models.BooleanField(
        default=False, help_text="Rejected because nobody decided in the organisation's time."
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["organisation", "status"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.thing} for {self.agent}"

    @property
    def thing(self) -> str:
        """What is asked for, as people say it: 'apt jq' or 'registry.example:443'."""
        return f"{self.ecosystem} {self.package}" if self.kind == Kind.PACKAGE else self.target


class Requester(models.Model):
    """One asking: the first, and each duplicate merged into the request."""

    request = models.ForeignKey(Request, on_delete=models.PROTECT, related_name="requesters")
    agent = models.ForeignKey("agents.Agent", on_delete=models.PROTECT, related_name="+")
    run = models.ForeignKey(
        "runs.Run", on_delete=models.SET_NULL, null=True, blank=True, related_name="requests"
    )
    reason = models.TextField(help_text="The agent's stated reason.")
    refusal = models.ForeignKey(
        "egress.Decision",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="The proxy's refusal that prompted it (its decision log row).",
    )
    filed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="+",
        help_text="A person who filed it on the agent's behalf (none: the agent itself).",
    )
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["request_id", "at", "id"]

    def __str__(self) -> str:
        return f"{self.agent} on {self.request_id}"


class Grant(models.Model):
    """An entry an approval added to one allowlist, and when it went again."""

    request = models.ForeignKey(Request, on_delete=models.PROTECT, related_name="grants")
    entry = models.CharField(max_length=300)
    agent = models.ForeignKey(
        "agents.Agent", on_delete=models.PROTECT, null=True, blank=True, related_name="grants"
    )
    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.PROTECT, related_name="grants"
    )
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    added = models.BooleanField(
        default=True,
        help_text="The approval put the entry there (False: it was there already, and its"
        " expiry removes nothing).",
    )
    added_version = models.PositiveIntegerField(
        null=True, blank=True, help_text="The agent version that added it (none: the base list)."
    )
    removed_at = models.DateTimeField(null=True, blank=True)
    removed_version = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["request_id", "id"]

    def __str__(self) -> str:
        where = self.agent or f"{self.organisation} base list"
        return f"{self.entry} on {where}"
