"""Admin for organisations and their members, written for operators."""

from typing import Any

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from simple_history.admin import SimpleHistoryAdmin

from organisations import services
from organisations.models import Membership, Organisation


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Organisation)
class OrganisationAdmin(SimpleHistoryAdmin):
    """Organisations are made and changed through the same service as in the API: a new one
    starts with the base allowlist (COVEY_EGRESS_BASE_ALLOWLIST, shown filled in), gets its
    built-in runner, and its creator becomes its admin."""

    list_display = ["name", "slug", "base_allowlist_size", "agent_count", "created_at"]
    search_fields = ["name", "slug"]
    inlines = [MembershipInline]
    history_list_display = ["base_allowlist"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["created_at"] if obj is None else ["slug", "created_at"]

    def get_prepopulated_fields(self, request: HttpRequest, obj: Any = None) -> dict[str, Any]:
        return {"slug": ["name"]} if obj is None else {}

    def save_model(self, request: HttpRequest, obj: Organisation, form: Any, change: bool) -> None:
        data = form.cleaned_data
        if change:
            fields = ("name", "base_allowlist", "request_expiry_minutes")
            changes = {f: data[f] for f in fields if f in form.changed_data}
            services.update_organisation(obj, by=request.user, **changes)
            return
        created = services.create_organisation(
            data["name"],
            by=request.user,
            slug=data["slug"],
            base_allowlist=data["base_allowlist"],
            request_expiry_minutes=data.get("request_expiry_minutes"),
        )
        obj.pk, obj.created_at, obj.updated_at = created.pk, created.created_at, created.updated_at
        obj._state.adding = False

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        if formset.model is not Membership or change:
            super().save_formset(request, form, formset, change)
            return
        # A new organisation's creator is a member already (the service made them admin): a
        # row for them in the inline sets their role instead of adding them twice.
        for member in formset.save(commit=False):
            existing = Membership.objects.filter(
                organisation_id=member.organisation_id, user_id=member.user_id
            ).first()
            if existing is not None and existing.pk != member.pk:
                existing.role = member.role
                existing.save(update_fields=["role"])
            else:
                member.save()
        for member in formset.deleted_objects:
            member.delete()

    def delete_model(self, request: HttpRequest, obj: Organisation) -> None:
        services.delete_organisation(obj, by=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Organisation]) -> None:
        for organisation in queryset:
            services.delete_organisation(organisation, by=request.user)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Organisation]:
        return super().get_queryset(request).annotate(agent_total=Count("agents"))

    @admin.display(description="Base entries")
    def base_allowlist_size(self, obj: Organisation) -> int:
        return len(obj.base_allowlist)

    @admin.display(description="Agents", ordering="agent_total")
    def agent_count(self, obj: Any) -> int:
        return int(obj.agent_total)


@admin.register(Membership)
class MembershipAdmin(SimpleHistoryAdmin):
    list_display = ["user", "organisation", "role"]
    list_filter = ["role", "organisation"]
    list_select_related = ["user", "organisation"]
    search_fields = ["user__username", "user__email", "organisation__name"]
    autocomplete_fields = ["user", "organisation"]
