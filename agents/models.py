"""Organisations, their members, the agents they govern (with versioned configuration), and the
agents' runs: the work waiting and its history."""

import uuid
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from simple_history.models import HistoricalRecords

from egress.entries import normalise_entries
from egress.fields import AllowlistField


def default_base_allowlist() -> list[str]:
    """The base allowlist a new organisation starts with (COVEY_EGRESS_BASE_ALLOWLIST)."""
    return normalise_entries(settings.COVEY_EGRESS_BASE_ALLOWLIST)


class Role(models.TextChoices):
    """What a member may do in an organisation."""

    ADMIN = "admin", "Admin"  # changes the organisation, its agents and workplaces
    APPROVER = "approver", "Approver"  # decides requests; reads everything
    VIEWER = "viewer", "Viewer"  # reads everything


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

    class Meta:
        ordering = ["organisation_id", "user_id"]
        constraints = [
            models.UniqueConstraint(fields=["organisation", "user"], name="membership_unique_user")
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.role}) in {self.organisation}"


class Agent(models.Model):
    """An AI coding agent. Its configuration is versioned: see :class:`AgentVersion`.

    Change an agent only through ``agents.services.update_agent``, which numbers the versions.
    """

    organisation = models.ForeignKey(Organisation, on_delete=models.PROTECT, related_name="agents")
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100)
    enabled = models.BooleanField(default=True)
    templates = models.ManyToManyField(
        "templates.AllowlistTemplate", blank=True, related_name="agents"
    )
    allowlist = AllowlistField(help_text="The agent's own entries, on top of base and templates.")
    required_labels = models.JSONField(
        default=list, blank=True, help_text="The agent runs only on runners with all these labels."
    )
    workplace = models.ForeignKey(
        "workplaces.Workplace",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="agents",
    )
    runtime_command = models.JSONField(
        default=list,
        blank=True,
        help_text="The command the sandbox runs (argv); empty: the Claude runtime with the task.",
    )
    cpus = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=1,
        validators=[MinValueValidator(Decimal("0.01")), MaxValueValidator(Decimal(256))],
    )
    memory_mb = models.PositiveIntegerField(
        default=2048, validators=[MinValueValidator(64), MaxValueValidator(1024 * 1024)]
    )
    pids_limit = models.PositiveIntegerField(
        default=512, validators=[MinValueValidator(16), MaxValueValidator(1_000_000)]
    )
    run_timeout = models.PositiveIntegerField(
        default=3600,
        validators=[MinValueValidator(1), MaxValueValidator(7 * 24 * 3600)],
        help_text="Seconds a run may take before it is stopped (timed out).",
    )
    home_runner = models.ForeignKey(
        "runners.Runner",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="homes",
        help_text="The runner that holds the agent's home; its runs go there. Clear it to move.",
    )
    version = models.PositiveIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["organisation_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organisation", "name"], name="agent_unique_name"),
            models.UniqueConstraint(fields=["organisation", "slug"], name="agent_unique_slug"),
        ]

    def __str__(self) -> str:
        return f"{self.organisation.slug}/{self.slug}"


# What people set on an agent, in the order forms show it; changes go through agents.services.
AGENT_FIELDS = (
    "name",
    "slug",
    "enabled",
    "workplace",
    "templates",
    "allowlist",
    "required_labels",
    "runtime_command",
    "cpus",
    "memory_mb",
    "pids_limit",
    "run_timeout",
    "home_runner",
)


class AgentVersion(models.Model):
    """One numbered configuration of an agent; rows are never changed once written."""

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    config = models.JSONField(help_text="The agent's whole configuration at this version.")
    changes = models.JSONField(
        default=dict, help_text="What changed from the previous version: field → [old, new]."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["agent_id", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["agent", "number"], name="agentversion_unique_number")
        ]

    def __str__(self) -> str:
        return f"{self.agent} v{self.number}"


class RunStatus(models.TextChoices):
    QUEUED = "queued"  # waiting for a runner
    PLACED = "placed"  # a runner was chosen and told
    STARTING = "starting"  # the runner is building the sandbox
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


FINISHED = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT}
)
ACTIVE = frozenset({RunStatus.PLACED, RunStatus.STARTING, RunStatus.RUNNING})


class RunQuerySet(TenantQuerySet):
    membership_lookup = "agent__organisation__memberships__user"


class Run(models.Model):
    """One piece of work for an agent, from the request to the end of its sandbox.

    Change a run's status only through ``agents.runs``, which records every step.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="runs")
    agent_version = models.ForeignKey(AgentVersion, on_delete=models.PROTECT, related_name="runs")
    task = models.TextField()
    status = models.CharField(
        max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED, db_index=True
    )
    status_detail = models.CharField(max_length=500, blank=True)
    runner = models.ForeignKey(
        "runners.Runner", on_delete=models.SET_NULL, null=True, blank=True, related_name="runs"
    )
    timeout = models.PositiveIntegerField(help_text="Seconds, from the agent at queueing.")
    exit_code = models.IntegerField(null=True, blank=True)
    log_tail = models.TextField(blank=True, help_text="The end of the output.")
    log = models.FileField(upload_to="runs/%Y/%m/", blank=True, help_text="The whole output.")
    output_size = models.BigIntegerField(
        default=0, help_text="Bytes of output received so far (UTF-8), live or whole."
    )
    log_start = models.BigIntegerField(
        default=0,
        help_text="Bytes at the start of the output that the whole log lacks (Docker keeps only"
        " the last 10 to 20 MB of a sandbox's output).",
    )
    egress_token = models.ForeignKey(
        "egress.EgressToken", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    placed_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["agent", "status"])]

    def __str__(self) -> str:
        return f"run {self.pk} of {self.agent} ({self.status})"

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


class RunOutput(models.Model):
    """A piece of a running run's output, as its runner sent it, at its byte offset. The whole
    log replaces them when the sandbox has ended."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="output")
    start = models.BigIntegerField(help_text="Byte offset of the text in the output (UTF-8).")
    end = models.BigIntegerField(help_text="Byte offset just past the text.")
    text = models.TextField()

    class Meta:
        ordering = ["run_id", "start"]
        constraints = [
            models.UniqueConstraint(fields=["run", "start"], name="runoutput_unique_start")
        ]

    def __str__(self) -> str:
        return f"{self.run_id} @{self.start}"


class RunEvent(models.Model):
    """One step in a run's status history."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    status = models.CharField(max_length=16, choices=RunStatus.choices)
    detail = models.CharField(max_length=500, blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run_id", "at", "id"]

    def __str__(self) -> str:
        return f"{self.run_id} {self.status}"
