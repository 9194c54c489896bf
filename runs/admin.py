"""Admin for runs, written for operators: what waits and what happened, read-only."""

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from runs import output, services
from runs.models import FINISHED, Run, RunEvent


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
        "workplace_shown",
        "image_id",
        "services_shown",
        "task",
        "status",
        "status_detail",
        "runner",
        "timeout",
        "exit_code",
        "log_tail",
        "log_link",
        "changes_in_home",
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
            path("<uuid:object_id>/log/", log, name="runs_run_log"),
            *super().get_urls(),
        ]

    @admin.display(description="Changes in the home")
    def changes_in_home(self, obj: Run) -> str:
        changed = obj.home_changes
        if not changed:
            browse = reverse("admin:homes_home_change", args=[obj.agent_id])
            said = "not recorded" if obj.finished_at else "-"
            return format_html('{} (<a href="{}">browse the home</a>)', said, browse)
        parts = []
        for kind in ("added", "changed", "removed"):
            listed, total = changed.get(kind, []), changed.get(f"{kind}_total", 0)
            if not total:
                continue
            more = f" and {total - len(listed)} more" if total > len(listed) else ""
            parts.append(
                format_html(
                    "<p><strong>{} {}</strong>{}</p><pre>{}</pre>",
                    total,
                    kind,
                    more,
                    "\n".join(listed),
                )
            )
        browse = format_html(
            '<p><a href="{}">Browse the home</a></p>',
            reverse("admin:homes_home_change", args=[obj.agent_id]),  # the homes app's browser
        )
        listed = format_html_join("", "{}", ((p,) for p in parts)) if parts else "nothing"
        return format_html("{}{}", listed, browse)

    @admin.display(description="Workplace")
    def workplace_shown(self, obj: Run) -> str:
        version = obj.workplace_version
        if version is None:
            return "-"
        url = reverse("admin:workplaces_workplaceversion_change", args=[version.pk])
        return format_html(
            '<a href="{}">{} v{}</a>', url, version.config.get("name"), version.number
        )

    @admin.display(description="Services")
    def services_shown(self, obj: Run) -> str:
        if not obj.services:
            return "-"
        return format_html_join(
            "",
            "<p><strong>{}</strong> image {}, ready after {}</p><pre>{}</pre>",
            (
                (
                    service.get("name"),
                    (service.get("image_id") or "?")[:19],
                    "-"
                    if service.get("ready_seconds") is None
                    else f"{service['ready_seconds']:.1f} s",
                    service.get("log") or "(no log yet)",
                )
                for service in obj.services
            ),
        )

    @admin.display(description="Output")
    def log_link(self, obj: Run) -> str:
        if obj.pk is None:
            return "-"
        url = reverse("admin:runs_run_log", args=[obj.pk])
        what = "the whole output" if obj.log else "the output so far"
        return format_html('<a href="{}">{}</a>', url, what)

    def log_view(self, request: HttpRequest, object_id: Any) -> HttpResponseBase:
        """The run's output as text: the whole log once kept, else what arrived so far."""
        run = self.get_object(request, str(object_id))
        if run is None or not self.has_view_permission(request, run):
            raise Http404("no such run")
        return output.log_response(run)

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        cancelled = 0
        for run in queryset.exclude(status__in=FINISHED):
            services.cancel(run, by=request.user)
            cancelled += 1
        self.message_user(request, f"{cancelled} run(s) cancelled or cancelling.", messages.SUCCESS)
