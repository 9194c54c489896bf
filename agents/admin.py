"""Admin for agents and their versions, written for operators."""

from types import SimpleNamespace
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from agents import services
from agents.labels import normalise_labels
from agents.models import AGENT_FIELDS, COMMAND_RULE, Agent, AgentVersion, is_command
from connections.admin import requests_link
from connections.grants import EXAMPLE, check_grants
from connections.models import Connection
from connections.services import kinds_of
from covey.versions import changes_table
from organisations.admin import StrictJSONField, TenantScoped
from organisations.models import Organisation
from organisations.readonly import VersionAdmin, VersionInline
from organisations.services import slug_for

# What an agent without a workplace of its own runs in, wherever that is shown.
DEFAULT_WORKPLACE = "the default workplace"


def workplace_shown(value: Any) -> str:
    """An agent's workplace as a version records it ({"id", "name"}, or None) for people."""
    if not value:
        return DEFAULT_WORKPLACE
    return str(value.get("name", value)) if isinstance(value, dict) else str(value)


def agent_changes(version: AgentVersion) -> str:
    """What an agent's version changed, its workplace by name ("the default workplace" when
    it had none) rather than as stored."""
    changes = dict(version.changes or {})
    if "workplace" in changes:
        changes["workplace"] = [workplace_shown(value) for value in changes["workplace"]]
    return changes_table(SimpleNamespace(number=version.number, changes=changes))


class AgentVersionInline(VersionInline):
    model = AgentVersion

    @admin.display(description="Changes")
    def changes_shown(self, obj: AgentVersion) -> str:
        return agent_changes(obj)


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


class CommandField(StrictJSONField):
    """A command as a JSON list of arguments; empty means the Claude runtime."""

    default_error_messages = {"invalid": COMMAND_RULE}

    def to_python(self, value: Any) -> Any:
        command = super().to_python(value)
        if command in (None, ""):
            return []
        if not is_command(command):
            raise ValidationError(self.error_messages["invalid"], code="invalid")
        return command


class GrantsField(StrictJSONField):
    """Grants as a JSON list; empty means none."""

    def to_python(self, value: Any) -> Any:
        grants = super().to_python(value)
        return [] if grants in (None, "") else grants


class AgentForm(forms.ModelForm):
    required_labels = LabelsField(
        required=False, help_text="Comma-separated; the agent runs only on runners with all."
    )
    credential_grants = GrantsField(
        required=False,
        initial=list,
        help_text="What it may do with the organisation's connections, a JSON list of grants,"
        f" e.g. {EXAMPLE}; defaults are filled in when saved (docs/credentials.md).",
    )
    runtime_command = CommandField(
        required=False,
        initial=list,  # a new agent's box shows [] (the Claude runtime), not null
        help_text='A JSON list of arguments, e.g. ["sh", "-c", "make test"]; empty: the Claude'
        " runtime on the task.",
    )

    class Meta:
        model = Agent
        fields = ["organisation", *AGENT_FIELDS]
        labels = {
            "cpus": "CPUs",
            "memory_mb": "Memory (MiB)",
            "pids_limit": "Processes (at most)",
            "run_timeout": "Run timeout (seconds)",
            "home_quota_mb": "Home quota (MiB)",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        workplace = self.fields.get("workplace")
        if workplace is not None:  # not when the page is read only
            workplace.empty_label = DEFAULT_WORKPLACE  # type: ignore[attr-defined]
            workplace.help_text = f"Empty: {DEFAULT_WORKPLACE} (COVEY_DEFAULT_IMAGE)."

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
        if organisation and "credential_grants" in data:
            slug = self.instance.slug or slug_for(data.get("name") or "")
            try:
                data["credential_grants"] = check_grants(
                    data["credential_grants"], agent=slug, connections=kinds_of(organisation.pk)
                )
            except ValueError as exc:
                self.add_error("credential_grants", str(exc))
        return data


HISTORY_LIMIT = 200  # rows of each kind on an organisation's credential history


def credential_history(organisation: Organisation, limit: int) -> list[dict[str, Any]]:
    """Its connections made, changed, rotated and deleted, and its agents' grants as they
    changed (each version that set them), newest first."""
    rows: list[dict[str, Any]] = []
    records = (
        Connection.history.filter(organisation_id=organisation.pk)
        .select_related("history_user")
        .order_by("-history_date", "-history_id")[:limit]
    )
    for record in records:
        kind = record.history_type
        previous = record.prev_record if kind == "~" else None
        if kind == "+":
            what, detail = f"connection {record.name} made", record.get_kind_display()
        elif kind == "-":
            what, detail = f"connection {record.name} deleted", ""
        elif previous is not None and previous.secret_set_at != record.secret_set_at:
            what, detail = f"credential of {record.name} rotated", ""
        else:
            changed = record.diff_against(previous).changed_fields if previous else []
            what, detail = f"connection {record.name} changed", ", ".join(changed)
        url = (
            "" if kind == "-" else reverse("admin:connections_connection_change", args=[record.id])
        )
        rows.append({"at": record.history_date, "by": record.history_user, "what": what,
                     "detail": detail, "url": url})  # fmt: skip
    versions = (
        AgentVersion.objects.filter(agent__organisation=organisation)
        .filter(Q(changes__has_key="credential_grants") | Q(number=1))
        .select_related("agent", "created_by")
        .order_by("-created_at")[:limit]
    )
    for version in versions:
        grants = version.config.get("credential_grants") or []
        if version.number == 1 and not grants:
            continue
        named = ", ".join(str(g.get("connection")) for g in grants) or "none"
        rows.append({
            "at": version.created_at, "by": version.created_by,
            "what": f"grants of {version.agent.name} (version {version.number})",
            "detail": f"connections: {named}",
            "url": reverse("admin:agents_agent_change", args=[version.agent_id]),
        })  # fmt: skip
    rows.sort(key=lambda row: row["at"], reverse=True)
    return rows


@admin.register(Agent)
class AgentAdmin(TenantScoped, admin.ModelAdmin):
    form = AgentForm
    list_display = [
        "name",
        "organisation",
        "enabled",
        "version",
        "template_list",
        "home_usage",
        "updated_at",
    ]
    list_filter = ["enabled", "organisation", "templates"]
    list_select_related = ["organisation"]
    search_fields = ["name", "slug", "organisation__name"]
    prepopulated_fields = {"slug": ["name"]}
    filter_horizontal = ["templates"]
    readonly_fields = [
        "version",
        "effective_allowlist",
        "home_usage",
        "home_measured_at",
        "home_browser",
        "credentialed_shown",
        "created_at",
        "updated_at",
    ]
    inlines = [AgentVersionInline]
    actions = ["enable_agents", "disable_agents"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Agent]:
        return super().get_queryset(request).prefetch_related("templates")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        """Nothing read-only on the add form: it shows only what can be set before saving
        (versions, usage, runs and spend come with the agent). Who may only read the agent
        sees its workplace in words."""
        if obj is None:
            return ()
        found = list(super().get_readonly_fields(request, obj))
        return found if self.has_change_permission(request, obj) else [*found, "workplace_shown"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = list(super().get_fields(request, obj))
        if "workplace_shown" not in fields:
            return fields
        fields.remove("workplace_shown")
        return [("workplace_shown" if name == "workplace" else name) for name in fields]

    @admin.display(description="Workplace")
    def workplace_shown(self, obj: Agent) -> str:
        return str(obj.workplace) if obj.workplace_id else DEFAULT_WORKPLACE

    def get_inlines(self, request: HttpRequest, obj: Any) -> Any:
        return super().get_inlines(request, obj) if obj is not None else []

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        """An agent's history is its versions: who changed what, when."""
        url = reverse("admin:agents_agentversion_changelist")
        return HttpResponseRedirect(f"{url}?{urlencode({'agent__id__exact': object_id})}")

    @admin.display(description="Home")
    def home_usage(self, obj: Agent) -> str:
        return obj.home_usage_text() if obj.pk else "-"

    @admin.display(description="Browse the home")
    def home_browser(self, obj: Agent) -> str:
        if obj.pk is None:
            return "-"
        url = reverse("admin:homes_home_change", args=[obj.pk])  # the homes app's file browser
        return format_html('<a href="{}">list, download, upload, move, delete</a>', url)

    def get_urls(self) -> list[Any]:
        history = self.admin_site.admin_view(self.credential_history_view)
        return [
            path(
                "credentials/<int:organisation_id>/",
                history,
                name="agents_agent_credential_history",
            ),
            *super().get_urls(),
        ]

    def credential_history_view(self, request: HttpRequest, organisation_id: int) -> HttpResponse:
        """An organisation's credential history (linked from its page): every member reads it."""
        organisation = (
            Organisation.objects.for_user(request.user).filter(pk=organisation_id).first()
        )
        if organisation is None:
            raise Http404("no such organisation")
        context = {
            **self.admin_site.each_context(request),
            "title": f"Credential history of {organisation}",
            "organisation": organisation,
            "rows": credential_history(organisation, HISTORY_LIMIT),
            "limit": HISTORY_LIMIT,
        }
        return TemplateResponse(request, "admin/agents/credential_history.html", context)

    @admin.display(description="Credentialed requests")
    def credentialed_shown(self, obj: Agent) -> str:
        """What it did with its organisation's connections (git through the gateway)."""
        return requests_link(obj.credentialed_requests.all(), agent__id__exact=obj.pk)

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
class AgentVersionAdmin(VersionAdmin):
    parent = "agent"
    list_display = ["agent", "number", "created_by", "created_at", "changes_shown"]
    list_filter = ["agent__organisation", "agent"]
    list_select_related = ["agent__organisation", "created_by"]
    search_fields = ["agent__name", "agent__slug"]

    @admin.display(description="Changes")
    def changes_shown(self, obj: AgentVersion) -> str:
        return agent_changes(obj)
