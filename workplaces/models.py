"""Workplaces: what an agent's sandbox is made from."""

from django.core.exceptions import ValidationError
from django.db import models

from covey.versions import Version
from organisations.models import TenantQuerySet
from workplaces.images import validate_image_reference


def _validate_image(value: str) -> None:
    try:
        validate_image_reference(value)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


class Workplace(models.Model):
    """What an organisation's agents run in: a base image, packages installed in an image made
    from it, companion services beside the sandbox, and a default command. Its configuration
    is versioned (:class:`WorkplaceVersion`): change it only through
    ``workplaces.services.update_workplace``."""

    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.PROTECT, related_name="workplaces"
    )
    name = models.CharField(max_length=100)
    image = models.CharField(
        "base image",
        max_length=255,
        validators=[_validate_image],
        help_text="The image sandboxes are made from, on the runner host (never pulled).",
    )
    description = models.TextField(blank=True)
    packages = models.JSONField(
        default=dict,
        blank=True,
        help_text="Packages installed on the base image, per ecosystem: an image is built once"
        " per version and reused.",
    )
    services = models.JSONField(
        default=list,
        blank=True,
        help_text="Companion services started beside each sandbox, reachable by name.",
    )
    runtime_command = models.JSONField(
        default=list,
        blank=True,
        help_text="The command sandboxes run (argv) unless the agent has its own; empty: the"
        " Claude runtime with the task.",
    )
    version = models.PositiveIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["organisation_id", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["organisation", "name"], name="workplace_unique_name_per_org"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.image})"


# What people set on a workplace, in the order forms show it; changes go through its services.
WORKPLACE_FIELDS = ("name", "description", "image", "packages", "services", "runtime_command")


class WorkplaceVersionQuerySet(TenantQuerySet):
    """Versions, scoped as their workplaces."""

    membership_lookup = "workplace__organisation__memberships__user"


class WorkplaceVersion(Version):
    """One numbered configuration of a workplace; rows are never changed once written."""

    workplace = models.ForeignKey(Workplace, on_delete=models.CASCADE, related_name="versions")

    objects = WorkplaceVersionQuerySet.as_manager()

    class Meta:
        ordering = ["workplace_id", "-number"]
        constraints = [
            models.UniqueConstraint(
                fields=["workplace", "number"], name="workplaceversion_unique_number"
            )
        ]

    def __str__(self) -> str:
        return f"{self.workplace.name} v{self.number}"
