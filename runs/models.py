"""Runs: one piece of work for an agent, from the request to the end of its sandbox, with its
status history and the output it sent while it went."""

import uuid

from django.conf import settings
from django.db import models

from agents.models import Agent, AgentVersion
from organisations.models import TenantQuerySet


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

    Change a run's status only through ``runs.services``, which records every step.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="runs")
    agent_version = models.ForeignKey(AgentVersion, on_delete=models.PROTECT, related_name="runs")
    workplace_version = models.ForeignKey(
        "workplaces.WorkplaceVersion",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="runs",
        help_text="The workplace version it was queued at: image, packages and services.",
    )
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
    home_changes = models.JSONField(
        null=True,
        blank=True,
        help_text="What the run changed in its agent's home: paths added, changed and removed"
        " (at most 1000 of each listed; the totals count them all). Empty: not recorded.",
    )
    image_id = models.CharField(
        max_length=100, blank=True, help_text="The ID of the image its sandbox ran."
    )
    services = models.JSONField(
        default=list,
        blank=True,
        help_text="Its workplace's services as they ran: name, image ID, seconds until ready,"
        " and the end of each one's log.",
    )
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

    @property
    def short_id(self) -> str:
        """The id's first eight characters, as lists show it (a search finds the run by it)."""
        return str(self.pk)[:8]


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
