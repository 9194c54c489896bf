"""Runners: hosts that run sandboxes for one organisation, and how they register."""

import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from egress.environment import Isolation
from organisations.models import TenantQuerySet
from runners.protocol import BUILTIN_QUEUE

# What a runner host says it enforces, as stored ("": it has not said yet).
ISOLATION_CHOICES = [("", "not said"), *((level.value, level.value) for level in Isolation)]


def builtin_goes_with_it(collector: Any, field: Any, sub_objs: Any, using: str) -> None:
    """on_delete of a runner's organisation: its built-in runner (which nobody made by hand)
    is deleted with it, any other runner protects it (ProtectedError: the API answers 409,
    the admin lists it), wherever the delete comes from."""
    others = sub_objs.filter(builtin=False)
    if others.exists():
        models.PROTECT(collector, field, others, using)
    models.CASCADE(collector, field, sub_objs.filter(builtin=True), using)


class RegistrationToken(models.Model):
    """A secret an operator hands to a new runner host so it can register; stored hashed."""

    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.CASCADE, related_name="registration_tokens"
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
        "organisations.Organisation", on_delete=builtin_goes_with_it, related_name="runners"
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
    isolation = models.CharField(
        max_length=20,
        blank=True,
        editable=False,
        choices=ISOLATION_CHOICES,
        help_text="What the runner host says it enforces: network (hard) or cooperative.",
    )
    host_ready = models.BooleanField(
        null=True,
        blank=True,
        editable=False,
        help_text="What the runner host said at its last heartbeat: whether it can take work"
        " (empty: it has not said).",
    )
    host_problem = models.TextField(
        blank=True,
        editable=False,
        help_text="Why it cannot, as the runner host said (Docker, isolation, probe, proxy).",
    )
    proxy_seen_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="When the runner's egress proxy last asked for its policy (remote runners'"
        " own proxies, and the proxy containers of hard isolation).",
    )
    last_probe = models.ForeignKey(
        "runners.Probe",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        editable=False,
        related_name="+",
        help_text="The runner's latest finished egress probe.",
    )

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
    def probe_passed(self) -> bool:
        """Not under hard isolation, or its latest egress probe passed."""
        if self.isolation != Isolation.NETWORK:
            return True
        return self.last_probe is not None and self.last_probe.status == ProbeStatus.PASSED

    @property
    def trusted(self) -> bool:
        """Under hard isolation, only once its latest egress probe passed, and while its host
        does not say it cannot take work (what it proved went, say, with its Docker engine)."""
        return self.probe_passed and (
            self.isolation != Isolation.NETWORK or self.host_ready is not False
        )

    def untrusted_reason(self) -> str:
        """Why a hard-isolation runner gets no work ('' when it does)."""
        if self.trusted:
            return ""
        probe = self.last_probe
        if probe is None:
            return "has not passed an egress probe yet"
        if probe.status != ProbeStatus.PASSED:
            when = probe.finished_at.strftime("%Y-%m-%d %H:%M:%S %Z") if probe.finished_at else ""
            return f"failed its egress probe at {when}: {probe.summary}"
        return f"cannot take work now: {self.host_problem}"

    @property
    def online(self) -> bool:
        """It has sent a heartbeat recently (COVEY_RUNNER_STALE_SECONDS)."""
        return self.last_seen_at is not None and self.last_seen_at >= stale_before()


class ProbeStatus(models.TextChoices):
    PENDING = "pending"  # ordered; the runner has not reported yet
    PASSED = "passed"  # every check held
    FAILED = "failed"  # something leaked, or the allowed vendor could not be reached
    ERROR = "error"  # the probe could not run (said in detail)


class ProbeQuerySet(TenantQuerySet):
    membership_lookup = "runner__organisation__memberships__user"


class Probe(models.Model):
    """One egress probe of a runner: what a sandbox in the runner's shape could reach.

    Ordered by a person (``manage.py egress_probe``) or by the runner host itself (at start,
    and again while the last one failed). The runner reports one line per check.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    runner = models.ForeignKey(Runner, on_delete=models.CASCADE, related_name="probes")
    agent = models.ForeignKey(
        "agents.Agent",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="Whose credentials and allowlist the proxy checks used.",
    )
    isolation = models.CharField(max_length=20, blank=True, choices=ISOLATION_CHOICES)
    status = models.CharField(
        max_length=10, choices=ProbeStatus.choices, default=ProbeStatus.PENDING
    )
    reason = models.CharField(max_length=100, help_text="Why it ran.")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    checks = models.JSONField(default=list, blank=True)  # [{category, target, verdict, observed}]
    summary = models.CharField(max_length=400, blank=True)
    detail = models.TextField(blank=True, help_text="Why the probe could not run.")
    egress_token = models.ForeignKey(
        "egress.EgressToken", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    objects = ProbeQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["runner", "-created_at"])]

    def __str__(self) -> str:
        return f"probe of {self.runner.name}: {self.status}"


def new_installation_key() -> str:
    return uuid.uuid4().hex[:12]


class Installation(models.Model):
    """This covey installation. Its key is on everything its runners make on a Docker engine,
    so two installations sharing one engine (or a test suite beside ``make run``) never touch
    each other's sandboxes. One row, made when first asked for (runners.services)."""

    key = models.CharField(max_length=12, unique=True, default=new_installation_key)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.key


def stale_before() -> datetime:
    """Runners last seen before this are stale (offline)."""
    return timezone.now() - timedelta(seconds=settings.COVEY_RUNNER_STALE_SECONDS)
