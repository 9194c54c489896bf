"""API: runners of your organisations (pause, resume), registration for new runner hosts, and
the endpoints runners themselves call with their runner token (``/api/v1/runner/``)."""

import uuid
from typing import Any

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import runs
from agents.models import Organisation, Role
from covey.api import OrganisationRolePermission
from runners import services
from runners.auth import IsRunner, RunnerTokenAuthentication
from runners.models import Runner


class RunnerSerializer(serializers.ModelSerializer):
    """A runner (its token is never shown again after registration)."""

    class Meta:
        model = Runner
        fields = [
            "id",
            "organisation",
            "name",
            "labels",
            "builtin",
            "paused",
            "online",
            "created_at",
            "last_seen_at",
        ]
        read_only_fields = fields


class RunnerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Runners of your organisations; admins pause and resume them."""

    queryset = Runner.objects.all()
    serializer_class = RunnerSerializer
    permission_classes = [permissions.IsAuthenticated, OrganisationRolePermission]
    write_roles = frozenset({Role.ADMIN})
    filterset_fields = ["organisation", "paused", "builtin"]

    def get_queryset(self) -> Any:
        return Runner.objects.for_user(self.request.user)

    def organisation_of(self, obj: Runner) -> Organisation:
        return obj.organisation

    @extend_schema(request=None, responses=RunnerSerializer)
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str | None = None) -> Response:
        """Finish what runs, accept nothing new; the runner keeps its token and homes."""
        runner = services.set_paused(self.get_object(), True)
        return Response(self.get_serializer(runner).data)

    @extend_schema(request=None, responses=RunnerSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str | None = None) -> Response:
        """Accept work again; waiting runs that fit are placed at once."""
        runner = services.set_paused(self.get_object(), False)
        return Response(self.get_serializer(runner).data)


class RegistrationSerializer(serializers.Serializer):
    """What a new runner host sends to register."""

    registration_token = serializers.CharField()
    name = serializers.CharField(max_length=100)
    labels = serializers.ListField(child=serializers.CharField(), required=False, default=list)


class RegisterRunnerView(APIView):
    """Exchange a registration token for a runner token (shown once)."""

    authentication_classes: list[Any] = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(request=RegistrationSerializer, responses={201: dict})
    def post(self, request: Request) -> Response:
        serializer = RegistrationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        runner, token = services.register_runner(
            data["registration_token"], data["name"], data["labels"]
        )
        body = {**RunnerSerializer(runner).data, "token": token}
        return Response(body, status=status.HTTP_201_CREATED)


# --- what runners call, with their runner token ------------------------------------------------


class RunnerEndpoint(APIView):
    authentication_classes = [RunnerTokenAuthentication]
    permission_classes = [IsRunner]

    def runner(self, request: Request) -> Runner:
        runner: Runner = request.auth  # type: ignore[assignment]
        return runner


class RunnerSelfView(RunnerEndpoint):
    """Who the calling runner is; calling it is also its heartbeat."""

    @extend_schema(responses=dict)
    def get(self, request: Request) -> Response:
        return Response(_me(self.runner(request)))

    @extend_schema(request=None, responses=dict)
    def post(self, request: Request) -> Response:
        """The heartbeat: the runner is alive; waiting runs that fit it are placed."""
        runner = self.runner(request)
        services.heartbeat(runner)
        return Response(_me(runner))


class RunnerPauseSerializer(serializers.Serializer):
    paused = serializers.BooleanField()


class RunnerPauseView(RunnerEndpoint):
    """Pause or resume from the runner host's command line."""

    @extend_schema(request=RunnerPauseSerializer, responses=dict)
    def post(self, request: Request) -> Response:
        serializer = RunnerPauseSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        runner = services.set_paused(self.runner(request), serializer.validated_data["paused"])
        return Response(_me(runner))


class RunnerRunsView(RunnerEndpoint):
    """The runs this runner should have a sandbox for (what it reconciles against)."""

    @extend_schema(responses=dict)
    def get(self, request: Request) -> Response:
        return Response({"runs": runs.runners_active_runs(self.runner(request))})


class RunStartView(RunnerEndpoint):
    """The runner is building the sandbox: the spec, with a fresh egress credential."""

    @extend_schema(request=None, responses={200: dict, 409: dict})
    def post(self, request: Request, run_id: str) -> Response:
        spec = runs.start(_run_id(run_id), self.runner(request))
        if spec is None:
            return Response(
                {"detail": "this run is not this runner's to start (cancelled or moved)"},
                status=status.HTTP_409_CONFLICT,
            )
        return Response(spec)


class RunReportSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=["running", "exited", "built", "vanished"])
    exit_code = serializers.IntegerField(required=False, allow_null=True)
    log_tail = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)
    detail = serializers.CharField(required=False, allow_blank=True, max_length=400)
    started_at = serializers.DateTimeField(required=False, allow_null=True)
    finished_at = serializers.DateTimeField(required=False, allow_null=True)


class RunReportView(RunnerEndpoint):
    """What the runner saw of a sandbox; answers with the run's status."""

    @extend_schema(request=RunReportSerializer, responses=dict)
    def post(self, request: Request, run_id: str) -> Response:
        serializer = RunReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = runs.report(_run_id(run_id), self.runner(request), **serializer.validated_data)
        if run is None:
            raise Http404("no such run on this runner")
        return Response({"run": str(run.pk), "status": run.status})


class RunLogView(RunnerEndpoint):
    """The whole output of a run whose sandbox has ended."""

    @extend_schema(request={"text/plain": str}, responses={204: None})
    def put(self, request: Request, run_id: str) -> Response:
        text = request.body.decode("utf-8", errors="replace")
        if runs.save_log(_run_id(run_id), self.runner(request), text) is None:
            raise Http404("no such run on this runner")
        return Response(status=status.HTTP_204_NO_CONTENT)


def _run_id(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise Http404("no such run") from None


def _me(runner: Runner) -> dict[str, Any]:
    return {
        "id": runner.pk,
        "name": runner.name,
        "organisation": runner.organisation_id,
        "labels": runner.labels,
        "builtin": runner.builtin,
        "paused": runner.paused,
        "queue": runner.queue,
    }
