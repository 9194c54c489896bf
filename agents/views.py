"""API resources: organisations, agents (with versions and effective allowlist), and runs."""

from typing import Any

from django.http import HttpResponseBase
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    inline_serializer,
)
from rest_framework import exceptions, mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from agents import runs, services
from agents.models import Agent, AgentVersion, Organisation, Role, Run
from agents.serializers import (
    AgentSerializer,
    AgentVersionSerializer,
    OrganisationSerializer,
    RunSerializer,
)
from covey.api import OrganisationRolePermission, OrganisationScopedViewSet


class CanCreateOrganisations(permissions.BasePermission):
    """Creating organisations is for the platform team (the ``add_organisation`` permission)."""

    message = "Creating organisations needs the 'agents.add_organisation' permission."

    def has_permission(self, request: Request, view: Any) -> bool:
        if view.action != "create":
            return True
        return bool(request.user.has_perm("agents.add_organisation"))


class OrganisationViewSet(OrganisationScopedViewSet):
    """Organisations you belong to. Admins change the name and the base allowlist."""

    queryset = Organisation.objects.all()
    serializer_class = OrganisationSerializer
    permission_classes = [*OrganisationScopedViewSet.permission_classes, CanCreateOrganisations]
    http_method_names = ["get", "post", "patch", "put", "head", "options"]
    filterset_fields = ["slug"]
    ordering_fields = ["name", "created_at"]


class AgentViewSet(OrganisationScopedViewSet):
    """Agents of your organisations. Every change to one creates a new numbered version."""

    queryset = Agent.objects.select_related("organisation", "workplace").prefetch_related(
        "templates"
    )
    serializer_class = AgentSerializer
    filterset_fields = ["organisation", "enabled", "slug"]
    ordering_fields = ["name", "created_at", "updated_at"]

    @extend_schema(responses=AgentVersionSerializer(many=True))
    @action(detail=True, methods=["get"])
    def versions(self, request: Request, pk: str | None = None) -> Response:
        """Every version of the agent's configuration, newest first."""
        agent = self.get_object()
        versions = agent.versions.select_related("created_by").order_by("-number")
        page = self.paginate_queryset(versions)
        return self.get_paginated_response(AgentVersionSerializer(page, many=True).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("from", int, required=True, description="Older version number."),
            OpenApiParameter("to", int, required=True, description="Newer version number."),
        ],
        responses=inline_serializer(
            "AgentVersionComparison",
            {
                "from": serializers.IntegerField(),
                "to": serializers.IntegerField(),
                "changes": serializers.DictField(),
            },
        ),
    )
    @action(detail=True, methods=["get"])
    def compare(self, request: Request, pk: str | None = None) -> Response:
        """What differs between two versions: field → [value in ``from``, value in ``to``]."""
        agent = self.get_object()
        numbers = {}
        for param in ("from", "to"):
            raw = request.query_params.get(param, "")
            if not raw.isdigit():
                raise exceptions.ValidationError({param: "give a version number"})
            numbers[param] = int(raw)
        old, new = (
            get_object_or_404(AgentVersion, agent=agent, number=numbers[p]) for p in ("from", "to")
        )
        return Response(
            {
                "from": old.number,
                "to": new.number,
                "changes": services.diff_configs(old.config, new.config),
            }
        )

    @extend_schema(
        responses=inline_serializer(
            "EffectiveAllowlist",
            {
                "version": serializers.IntegerField(),
                "entries": serializers.ListField(child=serializers.CharField()),
                "sources": serializers.DictField(child=serializers.ListField()),
            },
        )
    )
    @action(detail=True, methods=["get"], url_path="effective-allowlist")
    def effective_allowlist(self, request: Request, pk: str | None = None) -> Response:
        """Base + templates + own entries, normalised, deduplicated, sorted, as host:port."""
        agent = self.get_object()
        sources = services.effective_allowlist(agent)
        return Response(
            {
                "version": agent.version,
                "entries": [entry.host_port for entry in sources],
                "sources": {entry.host_port: where for entry, where in sources.items()},
            }
        )


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
    viewsets.GenericViewSet,
):
    """Runs of your organisations' agents: queue one, follow it, cancel it, read its output."""

    queryset = Run.objects.select_related(
        "agent__organisation", "agent_version", "runner", "created_by"
    ).prefetch_related("events")
    serializer_class = RunSerializer
    permission_classes = [permissions.IsAuthenticated, OrganisationRolePermission]
    write_roles = frozenset({Role.ADMIN})
    filterset_fields = ["agent", "status", "runner"]
    ordering_fields = ["created_at", "finished_at"]

    def get_queryset(self) -> Any:
        return self.queryset.for_user(self.request.user)

    def organisation_of(self, obj: Run) -> Organisation:
        return obj.agent.organisation

    @extend_schema(request=None, responses=RunSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel the run: at once while it waits, through its runner once it has one."""
        run = self.get_object()
        try:
            run = runs.cancel(run, by=request.user)
        except runs.RunError as exc:
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
        return runs.log_response(run, query.validated_data.get("offset", 0))
