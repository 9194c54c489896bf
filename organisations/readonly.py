"""The admin of records: what covey writes and nobody adds, changes or deletes by hand (the
audit and decision logs, proxy sessions, the ledger, requests, versions). :class:`ReadOnlyAdmin`
for their pages, :class:`ReadOnlyInline` for their rows on another page, and the pages of
versioned configuration (agents', workplaces') built on them."""

import json
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html

from covey.versions import changes_table
from organisations.admin import MembersRead, TenantScoped


class ReadOnlyAdmin:
    """A record's admin page: read as the admin it is mixed into says (first among its bases),
    never added, changed or deleted by hand."""

    record = True  # organisations/admin.py RoleRefusals: no row of it is anyone's to change

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nobody adds a record by hand."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nobody changes a record."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nobody deletes a record by hand (retention prunes, or its owner's deletion)."""
        return False


class ReadOnlyInline(ReadOnlyAdmin, MembersRead, admin.TabularInline):
    """Records on the page they belong to (the page is scoped already): every member reads
    them; nothing in them is added, changed or deleted."""

    extra = 0
    can_delete = False


class VersionInline(ReadOnlyInline):
    """A versioned object's history on its page: who changed what, when. Never edited."""

    ordering = ["-number"]
    fields = ("number", "created_at", "created_by", "reason", "changes_shown")
    readonly_fields = fields

    @admin.display(description="Changes")
    def changes_shown(self, obj: Any) -> str:
        return changes_table(obj)


class VersionAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    """Read-only: versions are a record, scoped as their objects. ``parent`` names the
    versioned object's field."""

    parent = ""
    readonly_fields = [
        "number", "created_by", "reason", "created_at", "changes_shown", "config_shown",
    ]  # fmt: skip

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [self.parent, *self.readonly_fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [self.parent, *self.readonly_fields]

    @admin.display(description="Changes")
    def changes_shown(self, obj: Any) -> str:
        return changes_table(obj)

    @admin.display(description="Configuration")
    def config_shown(self, obj: Any) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.config, indent=2, sort_keys=True))

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """Filtered to one object (its History button): the title names it."""
        parent_id = request.GET.get(f"{self.parent}__id__exact", "")
        model = self.model._meta.get_field(self.parent).related_model
        number = parent_id.isascii() and parent_id.isdigit()
        # The object, when the user may see it (the tenant-scoped admins' queryset says).
        parents = model._default_manager.filter(
            pk__in=self.get_queryset(request).values(self.parent)
        )
        found = parents.filter(pk=parent_id).first() if number else None
        if found is not None:
            extra_context = {**(extra_context or {}), "title": f"Versions of {found}"}
        return super().changelist_view(request, extra_context)
