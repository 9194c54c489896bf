"""API resources: agents, with their versions and effective allowlist."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from agents import services
from agents.models import Agent
from agents.serializers import (
    AgentSerializer,
    AgentVersionSerializer,
)
from covey.versions import versions_actions
from organisations.api import OrganisationScopedViewSet


class AgentViewSet(
    versions_actions(AgentVersionSerializer, "Agent"),  # type: ignore[misc]
    OrganisationScopedViewSet,
):
    """Agents of your organisations. Every change to one creates a new numbered version."""

    queryset = Agent.objects.select_related("organisation", "workplace").prefetch_related(
        "templates"
    )
    serializer_class = AgentSerializer
    filterset_fields = ["organisation", "enabled", "slug"]
    ordering_fields = ["name", "created_at", "updated_at"]

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
