"""The agents organisations govern, with their versioned configuration."""

from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from allowlists.fields import AllowlistField
from covey.versions import Version
from organisations.models import Organisation, TenantQuerySet

COMMAND_RULE = (
    'Give the command as a JSON list of arguments, e.g. ["sh", "-c", "echo hi"] (each a'
    " non-empty string; empty: the Claude runtime on the task)."
)


def is_command(value: object) -> bool:
    """A runtime command: a list of non-empty argument strings without NUL (empty: Claude)."""
    return isinstance(value, list) and all(
        isinstance(arg, str) and arg and "\0" not in arg for arg in value
    )


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
    credential_grants = models.JSONField(
        default=list,
        blank=True,
        help_text="What it may do with the organisation's connections, each grant over one"
        ' connection (docs/credentials.md), e.g. [{"connection": "github",'
        ' "repositories": ["acme/app"]}].',
    )
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
    home_quota_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(1024 * 1024 * 1024)],
        help_text="The most its home may hold, in MiB; empty: COVEY_HOME_QUOTA_MB. A run whose"
        " home holds more is refused before its sandbox is built.",
    )
    home_runner = models.ForeignKey(
        "runners.Runner",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="homes",
        help_text="The runner that holds the agent's home; its runs go there. Clear it to move.",
    )
    # What the home held when its runner last measured it (at the start and end of each run).
    home_bytes = models.BigIntegerField(null=True, blank=True, editable=False)
    home_files = models.BigIntegerField(null=True, blank=True, editable=False)
    home_measured_at = models.DateTimeField(null=True, blank=True, editable=False)
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

    @property
    def home_quota_bytes(self) -> int:
        return home_quota_bytes(self.home_quota_mb)

    def home_usage_text(self) -> str:
        """'1.2 GiB of 10.0 GiB (3,402 files)', or that it was never measured."""
        of = f"of {size_text(self.home_quota_bytes)}" if self.home_quota_bytes else "no quota"
        if self.home_measured_at is None or self.home_bytes is None:
            return f"not measured yet ({of})"
        files = self.home_files or 0
        return f"{size_text(self.home_bytes)} {of} ({files:,} file{'' if files == 1 else 's'})"


def home_quota_bytes(quota_mb: int | None) -> int:
    """A home quota in bytes (0: none): an agent's ``home_quota_mb``, else the setting's."""
    return int(quota_mb or settings.COVEY_HOME_QUOTA_MB) * 1024 * 1024


def size_text(count: int) -> str:
    """A number of bytes for people: 1.2 GiB, 300.0 KiB, 12 bytes."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


# What people set on an agent, in the order forms show it; changes go through agents.services.
AGENT_FIELDS = (
    "name",
    "slug",
    "enabled",
    "workplace",
    "templates",
    "allowlist",
    "credential_grants",
    "required_labels",
    "runtime_command",
    "cpus",
    "memory_mb",
    "pids_limit",
    "run_timeout",
    "home_quota_mb",
    "home_runner",
)


class AgentVersionQuerySet(TenantQuerySet):
    """Versions, scoped as their agents."""

    membership_lookup = "agent__organisation__memberships__user"


class AgentVersion(Version):
    """One numbered configuration of an agent; rows are never changed once written."""

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="versions")

    objects = AgentVersionQuerySet.as_manager()

    class Meta:
        ordering = ["agent_id", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["agent", "number"], name="agentversion_unique_number")
        ]

    def __str__(self) -> str:
        return f"{self.agent} v{self.number}"
