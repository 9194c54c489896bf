"""Admin for runners and their registration tokens."""

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from runners import services
from runners.models import RegistrationToken, Runner


@admin.register(Runner)
class RunnerAdmin(admin.ModelAdmin):
    """Online means a heartbeat within COVEY_RUNNER_STALE_SECONDS; stale runners get no work."""

    list_display = ["name", "organisation", "labels", "builtin", "online", "paused", "last_seen_at"]
    list_filter = ["paused", "builtin", "organisation"]
    list_select_related = ["organisation"]
    search_fields = ["name", "organisation__name"]
    readonly_fields = [
        "organisation",
        "builtin",
        "online",
        "token_prefix",
        "token_renewed_at",
        "created_at",
        "last_seen_at",
    ]
    fields = [
        "organisation",
        "name",
        "labels",
        "paused",
        "builtin",
        "online",
        "token_prefix",
        "token_renewed_at",
        "created_at",
        "last_seen_at",
    ]
    actions = ["pause_runners", "resume_runners"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # runners register themselves with a registration token

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


@admin.register(RegistrationToken)
class RegistrationTokenAdmin(admin.ModelAdmin):
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
