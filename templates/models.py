"""Allowlist templates: named sets of hosts an agent can be given in one step."""

from django.db import models
from simple_history.models import HistoricalRecords

from allowlists.fields import AllowlistField


class AllowlistTemplate(models.Model):
    """A named allowlist (e.g. ``npm``) that agents attach; editable to point at a mirror."""

    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    docs_url = models.URLField(blank=True, help_text="Where the ecosystem documents these hosts.")
    entries = AllowlistField()
    shipped_entries = AllowlistField(
        editable=False, help_text="The entries covey ships; 'restore' puts them back."
    )
    updated_at = models.DateTimeField(auto_now=True)
    history = HistoricalRecords()

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_modified(self) -> bool:
        """True when this installation changed the entries covey shipped."""
        return self.entries != self.shipped_entries
