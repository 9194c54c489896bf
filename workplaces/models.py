"""Workplaces: what an agent's sandbox is made from."""

from django.core.exceptions import ValidationError
from django.db import models
from simple_history.models import HistoricalRecords

from organisations.models import TenantQuerySet
from workplaces.images import validate_image_reference


def _validate_image(value: str) -> None:
    try:
        validate_image_reference(value)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


class Workplace(models.Model):
    """An image an organisation's agents run in (companion services come later)."""

    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.PROTECT, related_name="workplaces"
    )
    name = models.CharField(max_length=100)
    image = models.CharField(max_length=255, validators=[_validate_image])
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    history = HistoricalRecords()

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
