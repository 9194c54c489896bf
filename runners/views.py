"""API: runners of your organisations (pause, resume), registration for new runner hosts, and
the endpoints runners themselves call with their runner token (``/api/v1/runner/``)."""

import uuid
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, permissions, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.models import Agent
from agents.services import find_agent
from allowlists.entries import EntryError
from covey.api import RefusesUnknownFields
from egress import services as egress
from egress.messages import (
    BatchRefusalSerializer,
    DecisionBatchSerializer,
    PolicySerializer,
    RecordedSerializer,
)
from egress.protocol import POLICY_FORM, STREAM_HEADER, DecisionBatch, snapshot_v1_json
from organisations.api import OrganisationScoped
from runners import services
from runners.auth import RunnerEndpoint
from runners.messages import (
    HeartbeatSerializer,
    PauseOrderSerializer,
    ProbeBeginSerializer,
    ProbePlanSerializer,
    ProbeReportSerializer,
    ProbeStatusAnswerSerializer,
    Refusal,
    RegistrationSerializer,
    RunnerInfoSerializer,
)
from runners.models import Probe, Runner
from runners.probe import service as probes
from runners.protocol import (
    Heartbeat,
    PauseOrder,
    ProbeBegin,
    ProbeReport,
    ProbeStatusAnswer,
    Registration,
    RunnerInfo,
)
from wire import ProtocolError


class ProbeSerializer(serializers.ModelSerializer):
    """One egress probe of a runner, with one line per check."""

    agent: serializers.Field = serializers.StringRelatedField(allow_null=True)
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

    last_probe = LastProbeSerializer(read_only=True, allow_null=True)

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
            "host_ready",
            "host_problem",
            "created_at",
            "last_seen_at",
            "proxy_seen_at",
        ]
        read_only_fields = fields


class ProbeOrderSerializer(RefusesUnknownFields, serializers.Serializer):
    agent = serializers.CharField(
        required=False, help_text="id, slug or org-slug/agent-slug; default: the first that can"
    )


class RunnerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrganisationScoped):
    """Runners of your organisations; admins pause and resume them."""

    queryset = Runner.objects.select_related("last_probe")
    serializer_class = RunnerSerializer
    filterset_fields = ["organisation", "paused", "builtin"]

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


class RegisteredRunnerSerializer(RunnerSerializer):
    """A runner just registered: its token is in this answer and never again."""

    token = serializers.CharField(read_only=True, help_text="The runner token: shown once.")
    installation = serializers.CharField(read_only=True)

    class Meta(RunnerSerializer.Meta):
        fields = [*RunnerSerializer.Meta.fields, "token", "installation"]


class RegisterRunnerView(APIView):
    """Exchange a registration token for a runner token (shown once)."""

    authentication_classes: list[Any] = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(
        request=RegistrationSerializer,
        responses={201: RegisteredRunnerSerializer},
    )
    def post(self, request: Request) -> Response:
        serializer = RegistrationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        asked: Registration = serializer.validated_data
        runner, token = services.register_runner(
            asked.registration_token, asked.name, list(asked.labels)
        )
        body = {
            **RunnerSerializer(runner).data,
            "token": token,
            "installation": services.installation_key(),
        }
        return Response(body, status=status.HTTP_201_CREATED)


# --- what runners call, with their runner token ------------------------------------------------


class RunnerSelfView(RunnerEndpoint):
    """Who the calling runner is; calling it is also its heartbeat."""

    @extend_schema(responses=RunnerInfoSerializer)
    def get(self, request: Request) -> Response:
        return Response(_me(self.runner(request)))

    @extend_schema(request=HeartbeatSerializer, responses=RunnerInfoSerializer)
    def post(self, request: Request) -> Response:
        """The heartbeat: the runner is alive; waiting runs that fit it are placed."""
        serializer = HeartbeatSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        beat: Heartbeat = serializer.validated_data
        runner = self.runner(request)
        if beat.isolation is not None:
            probes.note_isolation(runner, beat.isolation)
        services.heartbeat(runner, beat.problem)
        return Response(_me(runner))


class RunnerPauseView(RunnerEndpoint):
    """Pause or resume from the runner host's command line."""

    @extend_schema(request=PauseOrderSerializer, responses=RunnerInfoSerializer)
    def post(self, request: Request) -> Response:
        serializer = PauseOrderSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        order: PauseOrder = serializer.validated_data
        runner = services.set_paused(self.runner(request), order.paused)
        return Response(_me(runner))


class RunnerProbesView(RunnerEndpoint):
    """The runner starts an egress probe (ordered, or its own): what to try, and as whom."""

    @extend_schema(request=ProbeBeginSerializer, responses={200: ProbePlanSerializer, 409: Refusal})
    def post(self, request: Request) -> Response:
        serializer = ProbeBeginSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        begun: ProbeBegin = serializer.validated_data
        try:
            order = probes.begin(
                self.runner(request),
                None if begun.probe is None else str(begun.probe),
                begun.isolation,
                begun.reason,
            )
        except probes.ProbeConflict as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(ProbePlanSerializer(order).data)


class RunnerProbeReportView(RunnerEndpoint):
    """What the runner's probe saw; answers with the probe's status."""

    @extend_schema(request=ProbeReportSerializer, responses=ProbeStatusAnswerSerializer)
    def post(self, request: Request, probe_id: uuid.UUID) -> Response:
        serializer = ProbeReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        report: ProbeReport = serializer.validated_data
        try:
            probe = probes.finish(self.runner(request), str(probe_id), report.checks, report.detail)
        except probes.ProbeConflict as exc:
            raise Http404(str(exc)) from None
        answer = ProbeStatusAnswer(probe=str(probe.pk), status=probe.status)
        return Response(ProbeStatusAnswerSerializer(answer).data)


def runner_info(runner: Runner) -> RunnerInfo:
    """Who the runner is, as the protocol says it."""
    return RunnerInfo(
        id=runner.pk,
        name=runner.name,
        organisation=runner.organisation_id,
        labels=tuple(runner.labels),
        builtin=runner.builtin,
        paused=runner.paused,
        queue=runner.queue,
        isolation=runner.isolation,
        installation=services.installation_key(),
    )


def _me(runner: Runner) -> Any:
    return RunnerInfoSerializer(runner_info(runner)).data


# --- what runners' egress proxies call, with the runner's token -------------------------------


class EgressPolicyView(RunnerEndpoint):
    """For proxies on runners: the egress policy of the runner's organisation.

    Answers 304 when ``If-None-Match`` names the current generation. A proxy asks for the
    policy with shared lists (``?v=2``); one of before gets each agent's whole allowlist
    (``entries``: entry → sources) instead, and is not told of the stream. Where the policy stream
    runs (COVEY_EGRESS_STREAM_URL), every answer names it in ``Covey-Policy-Stream``, and a
    proxy follows it from then on instead of polling (egress/stream/).
    """

    seen_as = "proxy"

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "v",
                str,
                enum=[POLICY_FORM],
                description="2: the policy with shared lists; without it, as a proxy of before"
                " them reads it",
            )
        ],
        responses={200: PolicySerializer, 304: None},
    )
    def get(self, request: Request) -> Response:
        runner = self.runner(request)
        generation = egress.policy_fingerprint(runner.organisation_id)
        headers = {"ETag": f'"{generation}"'}
        today = request.query_params.get("v") == POLICY_FORM
        if settings.COVEY_EGRESS_STREAM_URL and today:  # the stream sends today's form only
            headers[STREAM_HEADER] = settings.COVEY_EGRESS_STREAM_URL
        if request.headers.get("If-None-Match") == headers["ETag"]:
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers=headers)
        snapshot = egress.build_snapshot(runner.organisation_id)
        headers["ETag"] = f'"{snapshot.generation}"'
        if today:
            return Response(snapshot.to_json(), headers=headers)
        return Response(snapshot_v1_json(snapshot), headers=headers)  # a proxy of before


class DecisionIngestView(RunnerEndpoint):
    """For proxies on runners: store a batch of decisions in the log."""

    seen_as = "proxy"

    @extend_schema(
        request=DecisionBatchSerializer,
        responses={201: RecordedSerializer, 400: BatchRefusalSerializer},
    )
    def post(self, request: Request) -> Response:
        try:
            batch = DecisionBatch.from_json(request.data)
        except ProtocolError as exc:
            raise serializers.ValidationError({"events": [str(exc)]}) from None
        runner = self.runner(request)
        try:
            count = egress.record_decisions(
                batch.events, proxy=runner.name, organisation_id=runner.organisation_id
            )
        except egress.MALFORMED as exc:
            raise serializers.ValidationError({"events": [f"malformed event: {exc}"]}) from None
        return Response({"recorded": count}, status=status.HTTP_201_CREATED)
