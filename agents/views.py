"""API resources: agents, with their versions and effective allowlist."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    inline_serializer,
)
from rest_framework import exceptions, serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from agents import services
from agents.models import Agent, AgentVersion
from agents.serializers import (
    AgentSerializer,
    AgentVersionSerializer,
)
from organisations.api import OrganisationScopedViewSet


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
