"""Admin for egress tokens (listed, revocable) and the decision log (read-only)."""

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from egress import services
from egress.models import Decision, EgressToken
from organisations.admin import TenantScoped


@admin.register(EgressToken)
class EgressTokenAdmin(TenantScoped, admin.ModelAdmin):
    """Tokens are issued by runs and `manage.py egress_token`; here they are seen and revoked."""

    list_display = ["prefix", "agent", "purpose", "created_at", "expires_at", "revoked_at", "live"]
    list_filter = ["agent__organisation", "revoked_at", "expires_at"]
    list_select_related = ["agent__organisation"]
    search_fields = ["prefix", "agent__name", "agent__slug", "purpose"]
    readonly_fields = (
        "agent", "prefix", "purpose", "created_at", "expires_at", "revoked_at", "created_by",
    )  # fmt: skip
    fields = readonly_fields
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(boolean=True, description="Live")
    def live(self, obj: EgressToken) -> bool:
        return obj.is_live

    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[EgressToken]) -> None:
        count = services.revoke_tokens(queryset)
        self.message_user(request, f"{count} token(s) revoked.", messages.SUCCESS)


@admin.register(Decision)
class DecisionAdmin(TenantScoped, admin.ModelAdmin):
    """The proxy's record: never edited, never deleted by hand (pruned by retention)."""

    list_display = [
        "decided_at", "agent", "kind", "host", "port", "allowed", "reason", "address",
        "bytes_up", "bytes_down",
    ]  # fmt: skip
    list_filter = ["allowed", "reason", "kind", "agent__organisation", "decided_at"]
    list_select_related = ["agent__organisation"]
    search_fields = ["host", "username", "agent__name", "address"]
    date_hierarchy = "decided_at"
    show_full_result_count = False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Decision._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
