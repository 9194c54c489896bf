"""Admin for runners and their registration tokens."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from agents.admin import LabelsField
from allowlists.entries import EntryError
from covey.display import seconds
from egress.environment import Isolation
from organisations.admin import MembersRead, TenantScoped
from runners import services
from runners.models import Probe, ProbeStatus, RegistrationToken, Runner
from runners.probe import service as probes

PROBE_COLOURS = {
    ProbeStatus.PASSED: "#2e7d32",
    ProbeStatus.FAILED: "#c62828",
    ProbeStatus.ERROR: "#c62828",
    ProbeStatus.PENDING: "#757575",
}


def _probe_badge(probe: Probe | None) -> str:
    if probe is None:
        return "-"
    when = probe.finished_at or probe.created_at
    return format_html(
        '<span style="color: {}; font-weight: bold">{}</span> {}',
        PROBE_COLOURS.get(ProbeStatus(probe.status), "inherit"),
        probe.status,
        seconds(when),
    )


def _lines(probe: Probe) -> str:
    return format_html("<pre>{}</pre>", "\n".join(probes.lines(probe)) or "(no checks yet)")


class ProbeInline(MembersRead, admin.TabularInline):
    """The runner's latest probes (newest first); each line is one check."""

    model = Probe
    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = True
    fields = readonly_fields = ("created_at", "status", "isolation", "agent", "reason", "summary")
    ordering = ["-created_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Probe]:
        queryset: QuerySet[Probe] = super().get_queryset(request).select_related("agent")
        return queryset


RUNNER_FIELDS = (
    "organisation",
    "name",
    "labels",
    "paused",
    "builtin",
    "online",
    "isolation",
    "trusted",
    "host_status",
    "last_probe_status",
    "last_probe_lines",
    "token_prefix",
    "token_renewed_at",
    "created_at",
    "last_seen_at",
    "proxy_seen_at",
)


class RunnerForm(forms.ModelForm):
    labels = LabelsField(required=False, help_text="Comma-separated, as agents require them.")

    class Meta:
        model = Runner
        fields = ["name", "labels", "paused"]


def cooperative_warning(names: list[str]) -> str:
    """What the cooperative level leaves open, and how to close it, in the admin's words."""
    return (
        f"Cooperative isolation on {', '.join(names)}: sandboxes are told to use the egress"
        " proxy, and one that ignores its proxy settings reaches the network directly. For"
        " hard isolation (an internal network whose only exit is the proxy), start the runner"
        " host with COVEY_EGRESS_ISOLATION=network; its egress probe then proves it"
        " (docs/isolation.md)."
    )


@admin.register(Runner)
class RunnerAdmin(TenantScoped, admin.ModelAdmin):
    """Online means a heartbeat within COVEY_RUNNER_STALE_SECONDS; stale runners get no work.
    Under hard isolation a runner gets work only once its latest egress probe passed."""

    form = RunnerForm

    # What tells whether it works first, so it fits a 1280-pixel window.
    list_display = [
        "name",
        "organisation",
        "online",
        "last_seen_shown",
        "last_probe_status",
        "host_status",
        "paused",
        "isolation",
        "labels",
        "builtin",
    ]
    list_filter = ["paused", "builtin", "isolation", "organisation"]
    list_select_related = ["organisation", "last_probe"]
    search_fields = ["name", "organisation__name"]
    fields = RUNNER_FIELDS
    readonly_fields = tuple(
        name for name in RUNNER_FIELDS if name not in ("name", "labels", "paused")
    )
    inlines = [ProbeInline]
    actions = ["pause_runners", "resume_runners", "probe_runners"]

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """The platform team removes a runner (a dead host's); an organisation pauses its own,
        as the API lets it."""
        return bool(request.user.is_superuser)

    @admin.display(description="Last seen", ordering="last_seen_at")
    def last_seen_shown(self, obj: Runner) -> str:
        return seconds(obj.last_seen_at, empty="never")

    @admin.display(description="Last egress probe", ordering="last_probe__finished_at")
    def last_probe_status(self, obj: Runner) -> str:
        return _probe_badge(obj.last_probe)

    @admin.display(description="What the last probe saw")
    def last_probe_lines(self, obj: Runner) -> str:
        return "-" if obj.last_probe is None else _lines(obj.last_probe)

    @admin.display(description="Host", ordering="host_ready")
    def host_status(self, obj: Runner) -> str:
        # What the runner host said at its last heartbeat (its /readyz, bar the heartbeat).
        if obj.host_ready is None:
            return "-"
        colour = PROBE_COLOURS[ProbeStatus.PASSED if obj.host_ready else ProbeStatus.FAILED]
        return format_html(
            '<span style="color: {}; font-weight: bold">{}</span>{}',
            colour,
            "ready" if obj.host_ready else "not ready",
            "" if obj.host_ready else f": {obj.host_problem}",
        )

    @admin.display(boolean=True, description="Gets work")
    def trusted(self, obj: Runner) -> bool:
        return obj.trusted

    @admin.action(description="Run the egress probe", permissions=["change"])
    def probe_runners(self, request: HttpRequest, queryset: QuerySet[Runner]) -> None:
        ordered = 0
        for runner in queryset.select_related("organisation"):
            try:
                probes.order_probe(runner, by=request.user, reason="admin")
            except (ValidationError, EntryError) as exc:
                self.message_user(request, f"{runner.name}: {probes.words(exc)}", messages.ERROR)
            else:
                ordered += 1
        if ordered:
            self.message_user(
                request,
                f"Egress probe ordered on {ordered} runner(s); the result shows here when"
                " the runner reports (a few seconds).",
                messages.SUCCESS,
            )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # runners register themselves with a registration token

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        """The list, with what the cooperative level leaves open said above it whenever a
        runner it shows is at that level."""
        if request.method == "GET":
            shown = self.get_queryset(request).filter(isolation=Isolation.COOPERATIVE)
            names = list(shown.values_list("name", flat=True)[:5])
            if names:
                self.message_user(request, cooperative_warning(names), messages.WARNING)
        return super().changelist_view(request, extra_context)

    @admin.display(boolean=True, description="Online")
    def online(self, obj: Runner) -> bool:
        return obj.online

    def save_model(self, request: HttpRequest, obj: Runner, form: Any, change: bool) -> None:
        paused = obj.paused
        super().save_model(request, obj, form, change)
        if "paused" in form.changed_data:
            services.set_paused(obj, paused)  # resuming places what waits

    def _set_paused(self, request: HttpRequest, queryset: QuerySet[Runner], paused: bool) -> None:
        for runner in queryset:
            services.set_paused(runner, paused)
        word = "paused" if paused else "resumed"
        self.message_user(request, f"{queryset.count()} runner(s) {word}.", messages.SUCCESS)

    @admin.action(description="Pause: finish what runs, accept nothing new", permissions=["change"])
    def pause_runners(self, request: HttpRequest, queryset: QuerySet[Runner]) -> None:
        self._set_paused(request, queryset, True)

    @admin.action(description="Resume selected runners", permissions=["change"])
    def resume_runners(self, request: HttpRequest, queryset: QuerySet[Runner]) -> None:
        self._set_paused(request, queryset, False)


@admin.register(Probe)
class ProbeAdmin(TenantScoped, admin.ModelAdmin):
    """Egress probes: what a sandbox in each runner's shape could reach. Read-only."""

    list_display = ["created_at", "runner", "status_badge", "isolation", "agent", "reason"]
    list_filter = ["status", "isolation", "runner__organisation"]
    list_select_related = ["runner", "runner__organisation", "agent"]
    search_fields = ["runner__name", "summary"]
    fields = readonly_fields = (
        "runner",
        "status_badge",
        "isolation",
        "agent",
        "reason",
        "requested_by",
        "created_at",
        "finished_at",
        "summary",
        "detail",
        "check_lines",
    )

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_superuser)  # a record: only as its runner goes

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # ordered from a runner's page, the API or manage.py egress_probe

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the record stays as the runner reported it

    @admin.display(description="Status", ordering="status")
    def status_badge(self, obj: Probe) -> str:
        return _probe_badge(obj)

    @admin.display(description="Checks")
    def check_lines(self, obj: Probe) -> str:
        return _lines(obj)


@admin.register(RegistrationToken)
class RegistrationTokenAdmin(TenantScoped, admin.ModelAdmin):
    """Create one to register a runner host; the secret is shown once, after saving."""

    list_display = ["prefix", "organisation", "description", "created_at", "revoked_at"]
    list_filter = ["organisation"]
    list_select_related = ["organisation"]
    fields = ["organisation", "description", "expires_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["organisation", "prefix", "created_at"] if obj else []

    def save_model(
        self, request: HttpRequest, obj: RegistrationToken, form: Any, change: bool
    ) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        token, secret = services.create_registration_token(
            obj.organisation, by=request.user, description=obj.description
        )
        if obj.expires_at:
            token.expires_at = obj.expires_at
            token.save(update_fields=["expires_at"])
        obj.pk = token.pk
        self.message_user(
            request,
            f"Registration token (shown once): {secret} — on the runner host run "
            f"'manage.py runner_register --url URL --registration-token {secret}'.",
            messages.WARNING,
        )
