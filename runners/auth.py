"""API authentication for runners: ``Authorization: Runner <runner token>``."""

from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request
from rest_framework.views import APIView

from runners.models import Runner
from runners.services import runner_for_token

SEEN_EVERY_SECONDS = 10  # a runner's calls mark it seen this often at most (one write each)


class RunnerTokenAuthentication(authentication.BaseAuthentication):
    """Authenticates a runner; ``request.auth`` is the :class:`Runner`, the user anonymous."""

    keyword = "Runner"

    def authenticate(self, request: Request) -> tuple[Any, Runner] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode(errors="replace") != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Give the runner token after 'Runner '.")
        runner = runner_for_token(header[1].decode(errors="replace"))
        if runner is None:
            raise exceptions.AuthenticationFailed("Unknown runner token.")
        view = request.parser_context.get("view") if request.parser_context else None
        seen(runner, "proxy_seen_at" if getattr(view, "seen_as", "") == "proxy" else "last_seen_at")
        return AnonymousUser(), runner

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class RunnerTokenScheme(OpenApiAuthenticationExtension):
    """The runner token in the API's schema (its endpoints say how they are called)."""

    target_class = RunnerTokenAuthentication
    name = "runnerToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "'Runner <runner token>' (what runner_register saved)",
        }


def seen(runner: Runner, field: str) -> None:
    """Mark the runner's host (``last_seen_at``: what ``online`` reads) or its egress proxy
    (``proxy_seen_at``) seen now; at most one write per 10 s each."""
    now = timezone.now()
    last = getattr(runner, field)
    if last is None or (now - last).total_seconds() > SEEN_EVERY_SECONDS:
        Runner.objects.filter(pk=runner.pk).update(**{field: now})
        setattr(runner, field, now)


class IsRunner(permissions.BasePermission):
    """Only runners (with a runner token) may call this."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.auth, Runner)


class RunnerEndpoint(APIView):
    """An endpoint runners call with their runner token. ``seen_as``: whose call it is, the
    runner host's ("host": it is online) or its egress proxy's ("proxy")."""

    seen_as = "host"

    authentication_classes = [RunnerTokenAuthentication]
    permission_classes = [IsRunner]

    def runner(self, request: Request) -> Runner:
        runner: Runner = request.auth  # type: ignore[assignment]
        return runner
