"""Installing and restoring the shipped allowlist templates."""

from typing import Any

from allowlists.entries import normalise_entries
from templates.catalogue import SHIPPED
from templates.models import AllowlistTemplate


def install_shipped(model: Any = AllowlistTemplate) -> int:
    """Create missing shipped templates and refresh what 'shipped' means for existing ones.

    Entries an installation edited are kept. Takes the model class so a data migration can
    pass its historical model. Returns how many templates were created.
    """
    created = 0
    for shipped in SHIPPED:
        entries = normalise_entries(shipped.entries)
        template, was_created = model.objects.get_or_create(
            slug=shipped.slug,
            defaults={
                "name": shipped.name,
                "description": shipped.description,
                "docs_url": shipped.docs,
                "entries": entries,
                "shipped_entries": entries,
            },
        )
        if not was_created and template.shipped_entries != entries:
            template.shipped_entries = entries
            template.save(update_fields=["shipped_entries"])
        created += was_created
    return created


def restore_shipped(template: AllowlistTemplate) -> bool:
    """Put back the entries covey ships for this template; True if anything changed."""
    if not template.is_modified:
        return False
    template.entries = list(template.shipped_entries)
    template.save()
    return True
