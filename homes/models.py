"""Homes from outside: an operation ordered to the runner that holds an agent's home (kept
while it is carried out, then pruned), and the audit of every change made from outside (kept)."""

import uuid

from django.conf import settings
from django.db import models

from agents.models import Agent
from organisations.models import TenantQuerySet
from runners.protocol import CHANGING, HomeOp


class OperationState(models.TextChoices):
    ORDERED = "ordered"  # sent to the runner
    TAKEN = "taken"  # the runner has it
    STREAMING = "streaming"  # its bytes are coming (a download)
    ANSWERED = "answered"  # done (its answer says how it went)
    ABANDONED = "abandoned"  # its asker gave up on it: a late taking or answer is refused


class HomeOperation(models.Model):
    """One operation on an agent's home, while it is carried out by the runner holding it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="+")
    runner = models.ForeignKey("runners.Runner", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=[(op.value, op.value) for op in HomeOp])
    order = models.JSONField(help_text="The runners.protocol.HomeOrder the runner takes.")
    state = models.CharField(
        max_length=16, choices=OperationState.choices, default=OperationState.ORDERED
    )
    answer = models.JSONField(null=True, blank=True, help_text="runners.protocol.HomeAnswer")
    change = models.ForeignKey(
        "HomeChange",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="The audit record of a change, settled by its answer whenever it comes.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self) -> str:
        return f"{self.kind} in the home of {self.agent_id} ({self.state})"


class HomeChangeQuerySet(TenantQuerySet):
    membership_lookup = "agent__organisation__memberships__user"


class HomeChange(models.Model):
    """A change made to an agent's home from outside, or refused: who, what, how much, when."""

    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="home_changes")
    by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    by_name = models.CharField(max_length=150, help_text="Who, as they were called then.")
    operation = models.CharField(
        max_length=16, choices=[(op.value, op.value) for op in HomeOp if op in CHANGING]
    )
    path = models.TextField()
    target = models.TextField(blank=True, help_text="Where a move went.")
    bytes = models.BigIntegerField(default=0, help_text="An upload's size; what a delete removed.")
    status = models.PositiveSmallIntegerField(
        default=0, help_text="How it went, as HTTP says it (0: not known yet)."
    )
    detail = models.CharField(max_length=500, blank=True)
    settled = models.BooleanField(
        default=False, help_text="Its outcome is known: made, refused, or failed on the runner."
    )
    runner = models.ForeignKey(
        "runners.Runner", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = HomeChangeQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-pk"]

    def __str__(self) -> str:
        return f"{self.by_name} {self.operation} {self.path} ({self.status})"

    @property
    def done(self) -> bool:
        return 200 <= self.status < 300


class Home(Agent):
    """An agent seen as its home (the admin's file browser)."""

    class Meta:
        proxy = True
        verbose_name = "home"
        verbose_name_plural = "homes"
