"""Admin for runners and their registration tokens."""

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest

from runners import services
from runners.models import RegistrationToken, Runner


@admin.register(Runner)
class RunnerAdmin(admin.ModelAdmin):
    list_display = ["name", "organisation", "labels", "paused", "last_seen_at"]
    list_filter = ["paused", "organisation"]
    list_select_related = ["organisation"]
    search_fields = ["name", "organisation__name"]
    readonly_fields = ["organisation", "token_prefix", "created_at", "last_seen_at"]
    fields = [
        "organisation",
        "name",
        "labels",
        "paused",
        "token_prefix",
        "created_at",
        "last_seen_at",
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # runners register themselves with a registration token


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
