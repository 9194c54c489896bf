"""Admin for allowlist templates: edit one to point at a mirror, restore what covey ships."""

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from simple_history.admin import SimpleHistoryAdmin

from organisations.admin import PlatformOwned
from templates import services
from templates.models import AllowlistTemplate


@admin.register(AllowlistTemplate)
class AllowlistTemplateAdmin(PlatformOwned, SimpleHistoryAdmin):
    list_display = ["slug", "name", "entry_count", "is_modified", "updated_at"]
    search_fields = ["slug", "name", "entries"]
    readonly_fields = ["slug", "shipped_entries_shown", "updated_at"]
    fields = [
        "slug",
        "name",
        "description",
        "docs_url",
        "entries",
        "shipped_entries_shown",
        "updated_at",
    ]
    actions = ["restore_shipped"]
    history_list_display = ["entries"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # the thirteen ship with covey

    @admin.display(description="Entries")
    def entry_count(self, obj: AllowlistTemplate) -> int:
        return len(obj.entries)

    @admin.display(description="Modified", boolean=True)
    def is_modified(self, obj: AllowlistTemplate) -> bool:
        return obj.is_modified

    @admin.display(description="Shipped entries")
    def shipped_entries_shown(self, obj: AllowlistTemplate) -> str:
        return "\n".join(obj.shipped_entries)

    @admin.action(description="Restore the shipped entries", permissions=["change"])
    def restore_shipped(self, request: HttpRequest, queryset: QuerySet[AllowlistTemplate]) -> None:
        changed = sum(services.restore_shipped(template) for template in queryset)
        self.message_user(request, f"{changed} template(s) restored.", messages.SUCCESS)
