"""API authentication for runners: ``Authorization: Runner <runner token>``."""

from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request
from rest_framework.views import APIView

from runners.models import Runner
from runners.services import runner_for_token


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
        now = timezone.now()
        if runner.last_seen_at is None or (now - runner.last_seen_at).total_seconds() > 10:
            Runner.objects.filter(pk=runner.pk).update(last_seen_at=now)
            runner.last_seen_at = now
        return AnonymousUser(), runner

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class IsRunner(permissions.BasePermission):
    """Only runners (with a runner token) may call this."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.auth, Runner)


class RunnerEndpoint(APIView):
    """An endpoint runners call with their runner token."""

    authentication_classes = [RunnerTokenAuthentication]
    permission_classes = [IsRunner]

    def runner(self, request: Request) -> Runner:
        runner: Runner = request.auth  # type: ignore[assignment]
        return runner
