"""Admin for egress tokens (listed, revocable), the decision log and the proxies' sessions that
say what the log lacks (read-only)."""

from typing import Any

from django.contrib import admin, messages
from django.db.models import F, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html

from agents.models import size_text
from covey.display import seconds
from egress import services
from egress.models import Decision, EgressToken, ProxySession
from organisations.admin import TenantScoped
from organisations.readonly import ReadOnlyAdmin


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

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Revoked (its action), not deleted: the decision log names it. The platform team's
        # deletions take it along.
        return bool(request.user.is_superuser)

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
class DecisionAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    """The proxy's record: never edited, never deleted by hand (pruned by retention)."""

    # What matters first, so it is in view in a 1280-pixel window beside the filters: when,
    # allowed and why, where to, whose.
    list_display = [
        "decided_shown", "allowed", "reason", "destination", "agent", "kind", "address", "traffic",
    ]  # fmt: skip
    list_filter = ["allowed", "reason", "kind", "agent__organisation", "decided_at"]
    list_select_related = ["agent__organisation"]
    search_fields = ["host", "username", "agent__name", "address"]
    date_hierarchy = "decided_at"
    show_full_result_count = False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Decision._meta.fields]

    @admin.display(description="Decided at", ordering="decided_at")
    def decided_shown(self, obj: Decision) -> str:
        return seconds(obj.decided_at)

    @admin.display(description="Destination", ordering="host")
    def destination(self, obj: Decision) -> str:
        return f"{obj.host}:{obj.port}"

    @admin.display(description="Up / down")
    def traffic(self, obj: Decision) -> str:
        if obj.bytes_up is None and obj.bytes_down is None:
            return "-"
        return f"{size_text(obj.bytes_up or 0)} / {size_text(obj.bytes_down or 0)}"

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """Says so when the log is not whole: a proxy's session admits a gap."""
        gaps = with_gaps(ProxySession.objects.for_user(request.user)).count()
        if gaps and request.method == "GET":
            link = reverse("admin:egress_proxysession_changelist") + "?gap=yes"
            self.message_user(
                request,
                format_html(
                    'This log is not whole: <a href="{}">{} proxy session(s)</a> admit decisions'
                    " missing from it.",
                    link,
                    gaps,
                ),
                messages.WARNING,
            )
        return super().changelist_view(request, extra_context)


def with_gaps(sessions: QuerySet[ProxySession]) -> QuerySet[ProxySession]:
    """The sessions whose decisions the log does not all have."""
    return sessions.filter(Q(end=ProxySession.End.LOST) | Q(made__gt=F("recorded")))


class GapFilter(admin.SimpleListFilter):
    title = "gap in the log"
    parameter_name = "gap"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "admitted"), ("no", "none")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return with_gaps(queryset)
        if self.value() == "no":
            return queryset.exclude(pk__in=with_gaps(queryset).values("pk"))
        return queryset


@admin.register(ProxySession)
class ProxySessionAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    """Each proxy process's life: how many decisions it made, how many are in the log, and
    what the log admits it lacks. Written by the proxies, never by hand."""

    list_display = [
        "proxy", "organisation", "started_at", "ended_at", "end", "made", "recorded", "gap",
    ]  # fmt: skip
    list_filter = [GapFilter, "end", "organisation", "started_at"]
    list_select_related = ["organisation"]
    search_fields = ["proxy", "boot"]
    date_hierarchy = "started_at"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in ProxySession._meta.fields] + ["gap"]

    @admin.display(description="Not in the log")
    def gap(self, obj: ProxySession) -> str:
        return obj.gap or "-"
