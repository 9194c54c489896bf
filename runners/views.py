"""API: runners of your organisations (pause, resume), registration for new runner hosts, and
the endpoints runners themselves call with their runner token (``/api/v1/runner/``)."""

import uuid
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import runs
from agents.models import Agent, Organisation, Role
from agents.services import find_agent
from covey.api import OrganisationRolePermission
from egress.entries import EntryError
from egress.probe import Verdict
from runners import probes, services
from runners.auth import IsRunner, RunnerTokenAuthentication
from runners.client import OUTPUT_TOTAL_HEADER
from runners.models import Probe, Runner


class ProbeSerializer(serializers.ModelSerializer):
    """One egress probe of a runner, with one line per check."""

    agent: serializers.Field = serializers.StringRelatedField()
    lines = serializers.SerializerMethodField()

    class Meta:
        model = Probe
        fields = [
            "id",
            "runner",
            "agent",
            "isolation",
            "status",
            "reason",
            "created_at",
            "finished_at",
            "summary",
            "detail",
            "checks",
            "lines",
        ]
        read_only_fields = fields

    def get_lines(self, obj: Probe) -> list[str]:
        return probes.lines(obj)


class LastProbeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Probe
        fields = ["id", "status", "isolation", "finished_at", "summary"]
        read_only_fields = fields


class RunnerSerializer(serializers.ModelSerializer):
    """A runner (its token is never shown again after registration). ``trusted``: it may get
    work; a runner under hard isolation is trusted only once its latest probe passed."""

    last_probe = LastProbeSerializer(read_only=True)

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
            "isolation",
            "trusted",
            "last_probe",
            "created_at",
            "last_seen_at",
        ]
        read_only_fields = fields


class ProbeOrderSerializer(serializers.Serializer):
    agent = serializers.CharField(
        required=False, help_text="id, slug or org-slug/agent-slug; default: the first that can"
    )


class RunnerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Runners of your organisations; admins pause and resume them."""

    queryset = Runner.objects.all()
    serializer_class = RunnerSerializer
    permission_classes = [permissions.IsAuthenticated, OrganisationRolePermission]
    write_roles = frozenset({Role.ADMIN})
    filterset_fields = ["organisation", "paused", "builtin"]

    def get_queryset(self) -> Any:
        return Runner.objects.for_user(self.request.user).select_related("last_probe")

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

    @extend_schema(request=ProbeOrderSerializer, responses={202: ProbeSerializer})
    @action(detail=True, methods=["post"])
    def probe(self, request: Request, pk: str | None = None) -> Response:
        """Order an egress probe; follow it at ``probes/`` (it is pending until the runner
        reports)."""
        runner = self.get_object()
        serializer = ProbeOrderSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        agent = None
        if reference := serializer.validated_data.get("agent"):
            try:
                agent = find_agent(reference)
            except (Agent.DoesNotExist, Agent.MultipleObjectsReturned) as exc:
                raise serializers.ValidationError({"agent": [str(exc)]}) from None
        try:
            probe = probes.order_probe(runner, agent=agent, by=request.user, reason="API")
        except (DjangoValidationError, EntryError) as exc:
            raise serializers.ValidationError({"agent": [probes.words(exc)]}) from None
        return Response(ProbeSerializer(probe).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=ProbeSerializer(many=True))
    @action(detail=True, methods=["get"])
    def probes(self, request: Request, pk: str | None = None) -> Response:
        """The runner's latest egress probes, newest first."""
        runner = self.get_object()
        page = self.paginate_queryset(runner.probes.select_related("agent"))
        data = ProbeSerializer(page, many=True).data
        return self.get_paginated_response(data)


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
        body = {
            **RunnerSerializer(runner).data,
            "token": token,
            "installation": services.installation_key(),
        }
        return Response(body, status=status.HTTP_201_CREATED)


# --- what runners call, with their runner token ------------------------------------------------


class RunnerEndpoint(APIView):
    authentication_classes = [RunnerTokenAuthentication]
    permission_classes = [IsRunner]

    def runner(self, request: Request) -> Runner:
        runner: Runner = request.auth  # type: ignore[assignment]
        return runner


class HeartbeatSerializer(serializers.Serializer):
    isolation = serializers.ChoiceField(choices=probes.ISOLATIONS, required=False)


class RunnerSelfView(RunnerEndpoint):
    """Who the calling runner is; calling it is also its heartbeat."""

    @extend_schema(responses=dict)
    def get(self, request: Request) -> Response:
        return Response(_me(self.runner(request)))

    @extend_schema(request=HeartbeatSerializer, responses=dict)
    def post(self, request: Request) -> Response:
        """The heartbeat: the runner is alive; waiting runs that fit it are placed."""
        serializer = HeartbeatSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        runner = self.runner(request)
        if isolation := serializer.validated_data.get("isolation"):
            probes.note_isolation(runner, isolation)
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

    @extend_schema(
        request={"text/plain": str},
        parameters=[
            OpenApiParameter(
                OUTPUT_TOTAL_HEADER,
                int,
                OpenApiParameter.HEADER,
                description="Bytes the sandbox wrote in all, when the runner counted them.",
            )
        ],
        responses={204: None},
    )
    def put(self, request: Request, run_id: str) -> Response:
        text = request.body.decode("utf-8", errors="replace")
        raw = request.headers.get(OUTPUT_TOTAL_HEADER)
        total = None
        if raw is not None:
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
                raise serializers.ValidationError({OUTPUT_TOTAL_HEADER: "a number of bytes"})
            total = int(raw)
        if runs.save_log(_run_id(run_id), self.runner(request), text, total) is None:
            raise Http404("no such run on this runner")
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunOutputSerializer(serializers.Serializer):
    offset = serializers.IntegerField(min_value=0)
    text = serializers.CharField(
        allow_blank=True, trim_whitespace=False, max_length=runs.MAX_OUTPUT_CHUNK_BYTES
    )


class RunOutputView(RunnerEndpoint):
    """Output of a running sandbox, in order: ``offset`` is where ``text`` starts (bytes of
    UTF-8). 409 with ``size`` when the control plane has another amount: go on from there; 410
    when it takes no more live (the run ended, or has as much as it keeps while it goes)."""

    @extend_schema(request=RunOutputSerializer, responses={200: dict, 409: dict, 410: dict})
    def post(self, request: Request, run_id: str) -> Response:
        serializer = RunOutputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            run = runs.append_output(
                _run_id(run_id), self.runner(request), data["offset"], data["text"]
            )
        except runs.OutputConflict as exc:
            return Response({"detail": str(exc), "size": exc.size}, status=status.HTTP_409_CONFLICT)
        except runs.OutputClosed as exc:
            return Response({"detail": str(exc), "size": exc.size}, status=status.HTTP_410_GONE)
        if run is None:
            raise Http404("no such run on this runner")
        return Response({"run": str(run.pk), "size": run.output_size})


class ProbeBeginSerializer(serializers.Serializer):
    probe = serializers.UUIDField(required=False, allow_null=True)
    isolation = serializers.ChoiceField(choices=probes.ISOLATIONS)
    reason = serializers.CharField(required=False, allow_blank=True, max_length=100)


class RunnerProbesView(RunnerEndpoint):
    """The runner starts an egress probe (ordered, or its own): what to try, and as whom."""

    @extend_schema(request=ProbeBeginSerializer, responses={200: dict, 409: dict})
    def post(self, request: Request) -> Response:
        serializer = ProbeBeginSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        probe_id = data.get("probe")
        try:
            order = probes.begin(
                self.runner(request),
                None if probe_id is None else str(probe_id),
                data["isolation"],
                data.get("reason", ""),
            )
        except probes.ProbeConflict as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(order)


class ProbeCheckSerializer(serializers.Serializer):
    category = serializers.CharField(max_length=40)
    target = serializers.CharField(max_length=300)
    verdict = serializers.ChoiceField(choices=[v.value for v in Verdict])
    observed = serializers.CharField(max_length=1000, allow_blank=True)


class ProbeReportSerializer(serializers.Serializer):
    checks = ProbeCheckSerializer(many=True)
    detail = serializers.CharField(required=False, allow_blank=True, max_length=2000)


class RunnerProbeReportView(RunnerEndpoint):
    """What the runner's probe saw; answers with the probe's status."""

    @extend_schema(request=ProbeReportSerializer, responses=dict)
    def post(self, request: Request, probe_id: str) -> Response:
        serializer = ProbeReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            probe = probes.finish(
                self.runner(request), _run_id(probe_id), data["checks"], data.get("detail", "")
            )
        except probes.ProbeConflict as exc:
            raise Http404(str(exc)) from None
        return Response({"probe": str(probe.pk), "status": probe.status})


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
        "isolation": runner.isolation,
        "installation": services.installation_key(),
    }
