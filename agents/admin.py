"""Admin for organisations, members, agents, agent versions and runs, written for operators."""

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseRedirect,
)
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
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
    """Organisations are made and changed through the same service as in the API: a new one
    starts with the base allowlist (COVEY_EGRESS_BASE_ALLOWLIST, shown filled in), gets its
    built-in runner, and its creator becomes its admin."""

    list_display = ["name", "slug", "base_allowlist_size", "agent_count", "created_at"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline]
    history_list_display = ["base_allowlist"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["created_at"] if obj is None else ["slug", "created_at"]

    def get_prepopulated_fields(self, request: HttpRequest, obj: Any = None) -> dict[str, Any]:
        return {"slug": ["name"]} if obj is None else {}

    def save_model(self, request: HttpRequest, obj: Organisation, form: Any, change: bool) -> None:
        data = form.cleaned_data
        if change:
            changes = {f: data[f] for f in ("name", "base_allowlist") if f in form.changed_data}
            services.update_organisation(obj, by=request.user, **changes)
            return
        created = services.create_organisation(
            data["name"], by=request.user, slug=data["slug"], base_allowlist=data["base_allowlist"]
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
        return changes_table(obj)


def _shown(value: Any) -> str:
    """A configuration value as people read it: lists as comma-separated items."""
    if value is None or value == [] or value == "":
        return "—"
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return ", ".join(value)
    if isinstance(value, str | int | float | bool):
        return str(value)
    return json.dumps(value, sort_keys=True)


def _differences(field: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """A change as rows: a group of settings (the sandbox's) one row per setting that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            (f"{field} {key.replace('_', ' ')}", old.get(key), new.get(key))
            for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)
        ]
    return [(field, old, new)]


def changes_table(version: AgentVersion) -> str:
    """What a version changed, one row per field: before, after."""
    if not version.changes:
        return "created" if version.number == 1 else "no change"
    rows = format_html_join(
        "",
        "<tr><th>{}</th><td>{}</td><td>{}</td></tr>",
        (
            (field, _shown(old), _shown(new))
            for name, (old, new) in sorted(version.changes.items())
            for field, old, new in _differences(name.replace("_", " "), old, new)
        ),
    )
    return format_html(
        '<table class="covey-changes"><thead><tr><th>field</th><th>before</th>'
        "<th>after</th></tr></thead><tbody>{}</tbody></table>",
        rows,
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


class CommandField(forms.JSONField):
    """A command as a JSON list of arguments; empty means the Claude runtime."""

    default_error_messages = {
        "invalid": (
            'Give the command as a JSON list of arguments, e.g. ["sh", "-c", "echo hi"]'
            " (empty: the Claude runtime)."
        ),
    }

    def to_python(self, value: Any) -> Any:
        command = super().to_python(value)
        if command in (None, ""):
            return []
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
            raise ValidationError(self.error_messages["invalid"], code="invalid")
        return command


class AgentForm(forms.ModelForm):
    required_labels = LabelsField(
        required=False, help_text="Comma-separated; the agent runs only on runners with all."
    )
    runtime_command = CommandField(
        required=False,
        help_text='A JSON list of arguments, e.g. ["sh", "-c", "make test"]; empty: the Claude'
        " runtime on the task.",
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

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        """An agent's history is its versions: who changed what, when."""
        url = reverse("admin:agents_agentversion_changelist")
        return HttpResponseRedirect(f"{url}?{urlencode({'agent__id__exact': object_id})}")

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

    list_display = ["agent", "number", "created_by", "created_at", "changes_shown"]
    list_filter = ["agent__organisation", "agent"]
    list_select_related = ["agent__organisation", "created_by"]
    search_fields = ["agent__name", "agent__slug"]
    readonly_fields = [
        "agent", "number", "created_by", "created_at", "changes_shown", "config_shown"
    ]  # fmt: skip
    fields = tuple(readonly_fields)

    @admin.display(description="Changes")
    def changes_shown(self, obj: AgentVersion) -> str:
        return changes_table(obj)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """Filtered to one agent (its History button): the title names it."""
        agent_id = request.GET.get("agent__id__exact", "")
        agent = Agent.objects.filter(pk=agent_id).first() if agent_id.isdigit() else None
        if agent is not None:
            extra_context = {**(extra_context or {}), "title": f"Versions of {agent}"}
        return super().changelist_view(request, extra_context)

    @admin.display(description="Configuration")
    def config_shown(self, obj: AgentVersion) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.config, indent=2, sort_keys=True))

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
        "log_link",
        "output_size",
        "log_start",
        "created_by",
        "created_at",
        "placed_at",
        "started_at",
        "finished_at",
        "cancel_requested_at",
    ]
    fields = tuple(readonly_fields)  # a run is a record: nothing on its page is edited

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        no_saving = {"show_save": False, "show_save_and_continue": False}
        return super().change_view(
            request, object_id, form_url, {**(extra_context or {}), **no_saving}
        )

    def get_urls(self) -> list[Any]:
        log = self.admin_site.admin_view(self.log_view)
        return [
            path("<uuid:object_id>/log/", log, name="agents_run_log"),
            *super().get_urls(),
        ]

    @admin.display(description="Output")
    def log_link(self, obj: Run) -> str:
        if obj.pk is None:
            return "-"
        url = reverse("admin:agents_run_log", args=[obj.pk])
        what = "the whole output" if obj.log else "the output so far"
        return format_html('<a href="{}">{}</a>', url, what)

    def log_view(self, request: HttpRequest, object_id: Any) -> HttpResponseBase:
        """The run's output as text: the whole log once kept, else what arrived so far."""
        run = self.get_object(request, str(object_id))
        if run is None or not self.has_view_permission(request, run):
            raise Http404("no such run")
        return runs.log_response(run)

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        cancelled = 0
        for run in queryset.exclude(status__in=FINISHED):
            runs.cancel(run, by=request.user)
            cancelled += 1
        self.message_user(request, f"{cancelled} run(s) cancelled or cancelling.", messages.SUCCESS)
