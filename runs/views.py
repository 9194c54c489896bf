"""API resources: runs (queue, follow, cancel, read the output), and the endpoints runners
report to about the runs they were given."""

import uuid

from django.http import Http404, HttpResponseBase
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
)
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from covey.numbers import whole_number
from organisations.api import OrganisationScoped
from organisations.models import Organisation
from runners.auth import RunnerEndpoint
from runners.messages import (
    ActiveRunsSerializer,
    LaunchSpecSerializer,
    OutputAnswerSerializer,
    OutputChunkSerializer,
    Refusal,
    RunReportSerializer,
    RunStartSerializer,
    RunStatusAnswerSerializer,
)
from runners.protocol import OUTPUT_TOTAL_HEADER, OutputAnswer, RunStart, RunStatusAnswer
from runs import output, services
from runs.models import Run
from runs.serializers import RunSerializer


class LogQuerySerializer(serializers.Serializer):
    offset = serializers.IntegerField(
        min_value=0,
        max_value=2**62,
        required=False,
        error_messages={
            key: "give a number of bytes (0 or more)" for key in ("invalid", "min_value")
        },
    )


class RunViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    OrganisationScoped,
):
    """Runs of your organisations' agents: queue one, follow it, cancel it, read its output."""

    queryset = Run.objects.select_related(
        "agent__organisation", "agent_version", "workplace_version", "runner", "created_by"
    ).prefetch_related("events")
    serializer_class = RunSerializer
    filterset_fields = ["agent", "status", "runner"]
    ordering_fields = ["created_at", "finished_at"]

    def organisation_of(self, obj: Run) -> Organisation:
        return obj.agent.organisation

    @extend_schema(request=None, responses=RunSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel the run: at once while it waits, through its runner once it has one."""
        run = self.get_object()
        try:
            run = services.cancel(run, by=request.user)
        except services.RunError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(self.get_serializer(self.get_queryset().get(pk=run.pk)).data)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "offset",
                int,
                description="Bytes to skip: the X-Covey-Log-Size of the previous answer.",
            )
        ],
        responses={
            (200, "text/plain"): OpenApiResponse(
                str,
                description="X-Covey-Log-Size: where this answer ends (ask from there next);"
                " X-Covey-Log-Complete: true once the run has ended and nothing is left;"
                " X-Covey-Log-Start: bytes at the start of a large output the whole log lacks."
                " Live output comes at most 1 MiB per answer.",
            )
        },
    )
    @action(detail=True, methods=["get"])
    def log(self, request: Request, pk: str | None = None) -> HttpResponseBase:
        """The run's output as text, while it runs (sent every second or so) and once it has
        ended. Follow it by asking again with ``?offset=`` the ``X-Covey-Log-Size`` of the last
        answer until ``X-Covey-Log-Complete`` is ``true``."""
        run = self.get_object()
        query = LogQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        return output.log_response(run, query.validated_data.get("offset", 0))


# --- what runners call about their runs, with their runner token ----------------------------


class RunnerRunsView(RunnerEndpoint):
    """The runs this runner should have a sandbox for (what it reconciles against)."""

    @extend_schema(responses=ActiveRunsSerializer)
    def get(self, request: Request) -> Response:
        runs = services.runners_active_runs(self.runner(request))
        return Response(ActiveRunsSerializer(runs).data)


class RunStartView(RunnerEndpoint):
    """The runner is building the sandbox: the spec, with a fresh egress credential."""

    @extend_schema(request=RunStartSerializer, responses={200: LaunchSpecSerializer, 409: Refusal})
    def post(self, request: Request, run_id: uuid.UUID) -> Response:
        serializer = RunStartSerializer(data=request.data)  # no body: a runner from before features
        serializer.is_valid(raise_exception=True)
        asked: RunStart = serializer.validated_data
        spec = services.start(str(run_id), self.runner(request), frozenset(asked.features))
        if spec is None:
            return Response(
                {"detail": "this run is not this runner's to start (cancelled or moved)"},
                status=status.HTTP_409_CONFLICT,
            )
        return Response(LaunchSpecSerializer(spec).data)


class RunReportView(RunnerEndpoint):
    """What the runner saw of a sandbox; answers with the run's status."""

    @extend_schema(request=RunReportSerializer, responses=RunStatusAnswerSerializer)
    def post(self, request: Request, run_id: uuid.UUID) -> Response:
        serializer = RunReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = services.report(str(run_id), self.runner(request), serializer.validated_data)
        if run is None:
            raise Http404("no such run on this runner")
        answer = RunStatusAnswer(run=str(run.pk), status=run.status)
        return Response(RunStatusAnswerSerializer(answer).data)


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
    def put(self, request: Request, run_id: uuid.UUID) -> Response:
        text = request.body.decode("utf-8", errors="replace")
        raw = request.headers.get(OUTPUT_TOTAL_HEADER)
        total = whole_number(raw)
        if raw is not None and total is None:
            raise serializers.ValidationError({OUTPUT_TOTAL_HEADER: "a number of bytes"})
        if output.save_log(str(run_id), self.runner(request), text, total) is None:
            raise Http404("no such run on this runner")
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunOutputView(RunnerEndpoint):
    """Output of a running sandbox, in order: ``offset`` is where ``text`` starts (bytes of
    UTF-8). 409 with ``size`` when the control plane has another amount: go on from there; 410
    when it takes no more live (the run ended, or has as much as it keeps while it goes)."""

    @extend_schema(
        request=OutputChunkSerializer,
        responses={
            200: OutputAnswerSerializer,
            409: OutputAnswerSerializer,
            410: OutputAnswerSerializer,
        },
    )
    def post(self, request: Request, run_id: uuid.UUID) -> Response:
        serializer = OutputChunkSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        chunk = serializer.validated_data
        code: int
        try:
            run = output.append_output(str(run_id), self.runner(request), chunk.offset, chunk.text)
        except output.OutputConflict as exc:
            answer, code = OutputAnswer(exc.size, str(exc)), status.HTTP_409_CONFLICT
        except output.OutputClosed as exc:
            answer, code = OutputAnswer(exc.size, str(exc)), status.HTTP_410_GONE
        else:
            if run is None:
                raise Http404("no such run on this runner")
            answer, code = OutputAnswer(run.output_size), status.HTTP_200_OK
        return Response(OutputAnswerSerializer(answer).data, status=code)
