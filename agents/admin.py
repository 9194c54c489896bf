"""Admin for organisations, members, agents, agent versions and runs, written for operators."""

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from simple_history.admin import SimpleHistoryAdmin

from agents import runs, services
from agents.models import (
    AGENT_FIELDS,
    FINISHED,
    Agent,
    AgentVersion,
    Membership,
    Organisation,
    Run,
    RunEvent,
)
from runners.labels import normalise_labels


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Organisation)
class OrganisationAdmin(SimpleHistoryAdmin):
    list_display = ["name", "slug", "base_allowlist_size", "agent_count", "created_at"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    readonly_fields = ["created_at"]
    inlines = [MembershipInline]
    history_list_display = ["base_allowlist"]

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


class AgentVersionInline(admin.TabularInline):
    """The agent's history: who changed what, when. Versions are never edited."""

    model = AgentVersion
    extra = 0
    can_delete = False
    ordering = ["-number"]
    fields = ("number", "created_at", "created_by", "changes_shown")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="Changes")
    def changes_shown(self, obj: AgentVersion) -> str:
        if not obj.changes:
            return "created"
        return format_html_join(
            "",
            "<div><b>{}</b>: {} → {}</div>",
            (
                (field, json.dumps(old), json.dumps(new))
                for field, (old, new) in obj.changes.items()
            ),
        )


class LabelsField(forms.CharField):
    """Runner labels typed as a comma-separated list."""

    def prepare_value(self, value: Any) -> Any:
        return ", ".join(value) if isinstance(value, list | tuple) else value

    def to_python(self, value: Any) -> list[str]:  # type: ignore[override]
        if isinstance(value, list | tuple):
            items = list(value)
        else:
            items = [item.strip() for item in (value or "").split(",") if item.strip()]
        try:
            return normalise_labels(items)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


class AgentForm(forms.ModelForm):
    required_labels = LabelsField(
        required=False, help_text="Comma-separated; the agent runs only on runners with all."
    )

    class Meta:
        model = Agent
        fields = ["organisation", *AGENT_FIELDS]

    def clean_runtime_command(self) -> Any:
        return self.cleaned_data.get("runtime_command") or []  # empty: the Claude runtime

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        workplace, organisation = data.get("workplace"), data.get("organisation")
        if workplace and organisation and workplace.organisation_id != organisation.pk:
            self.add_error("workplace", "The workplace belongs to another organisation.")
        home = data.get("home_runner")
        if home and organisation and home.organisation_id != organisation.pk:
            self.add_error("home_runner", "The runner belongs to another organisation.")
        if self.instance.pk and organisation and organisation.pk != self.instance.organisation_id:
            self.add_error("organisation", "An agent cannot move to another organisation.")
        return data


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    form = AgentForm
    list_display = ["name", "organisation", "enabled", "version", "template_list", "updated_at"]
    list_filter = ["enabled", "organisation", "templates"]
    list_select_related = ["organisation"]
    search_fields = ["name", "slug", "organisation__name"]
    prepopulated_fields = {"slug": ["name"]}
    filter_horizontal = ["templates"]
    readonly_fields = ["version", "effective_allowlist", "created_at", "updated_at"]
    inlines = [AgentVersionInline]
    actions = ["enable_agents", "disable_agents"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Agent]:
        return super().get_queryset(request).prefetch_related("templates")

    @admin.display(description="Templates")
    def template_list(self, obj: Agent) -> str:
        return ", ".join(t.slug for t in obj.templates.all())

    @admin.display(description="Effective allowlist")
    def effective_allowlist(self, obj: Agent) -> str:
        if obj.pk is None:
            return "-"
        rows = services.effective_allowlist(obj)
        return format_html(
            "<table>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td></tr>",
                ((entry.host_port, ", ".join(src)) for entry, src in rows.items()),
            ),
        )

    def save_model(self, request: HttpRequest, obj: Agent, form: Any, change: bool) -> None:
        # Go through the service so the change is versioned like one made in the API.
        data = {field: form.cleaned_data[field] for field in AgentForm.Meta.fields}
        if change:
            data.pop("organisation")
            saved = services.update_agent(obj, by=request.user, **data)
        else:
            saved = services.create_agent(
                data.pop("organisation"), data.pop("name"), by=request.user, **data
            )
        obj.pk, obj.version = saved.pk, saved.version

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        # The service already set the templates; only inline formsets remain.
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)

    def _set_enabled(self, request: HttpRequest, queryset: QuerySet[Agent], value: bool) -> None:
        changed = 0
        for agent in queryset.filter(enabled=not value):
            services.update_agent(agent, by=request.user, enabled=value)
            changed += 1
        word = "enabled" if value else "disabled"
        self.message_user(request, f"{changed} agent(s) {word}.", messages.SUCCESS)

    @admin.action(description="Enable selected agents", permissions=["change"])
    def enable_agents(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        self._set_enabled(request, queryset, True)

    @admin.action(description="Disable selected agents", permissions=["change"])
    def disable_agents(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        self._set_enabled(request, queryset, False)


@admin.register(AgentVersion)
class AgentVersionAdmin(admin.ModelAdmin):
    """Read-only: versions are a record."""

    list_display = ["agent", "number", "created_by", "created_at"]
    list_filter = ["agent__organisation"]
    list_select_related = ["agent__organisation", "created_by"]
    search_fields = ["agent__name", "agent__slug"]
    readonly_fields = ["agent", "number", "config", "changes", "created_by", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class RunEventInline(admin.TabularInline):
    model = RunEvent
    extra = 0
    can_delete = False
    fields = ("at", "status", "detail")
    readonly_fields = ("at", "status", "detail")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    """What waits and what happened; runs are queued through the API, cancelled here."""

    list_display = ["id", "agent", "status", "status_detail", "runner", "created_at", "finished_at"]
    list_filter = ["status", "agent__organisation", "runner", "agent"]
    list_select_related = ["agent__organisation", "runner"]
    search_fields = ["id", "agent__name", "task"]
    date_hierarchy = "created_at"
    inlines = [RunEventInline]
    actions = ["cancel_runs"]
    readonly_fields = [
        "id",
        "agent",
        "agent_version",
        "task",
        "status",
        "status_detail",
        "runner",
        "timeout",
        "exit_code",
        "log_tail",
        "log",
        "created_by",
        "created_at",
        "placed_at",
        "started_at",
        "finished_at",
        "cancel_requested_at",
    ]
    exclude = ["egress_token"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        cancelled = 0
        for run in queryset.exclude(status__in=FINISHED):
            runs.cancel(run, by=request.user)
            cancelled += 1
        self.message_user(request, f"{cancelled} run(s) cancelled or cancelling.", messages.SUCCESS)
