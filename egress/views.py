"""API: egress tokens and the decision log for people; policy and log ingest for runners."""

from datetime import timedelta
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, mixins, serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from agents.models import Agent
from covey.api import RefusesUnknownFields
from egress import services
from egress.models import Decision, EgressToken
from organisations.api import OrganisationScoped, OrganisationScopedViewSet, ScopedRelatedField
from organisations.models import Role
from organisations.roles import role_of


class DecisionSerializer(serializers.ModelSerializer):
    """One allow or deny of the egress proxy."""

    class Meta:
        model = Decision
        fields = [
            "id", "agent", "username", "kind", "host", "port", "address", "allowed", "reason",
            "detail", "bytes_up", "bytes_down", "decided_at", "closed_at", "proxy",
        ]  # fmt: skip
        read_only_fields = fields


class DecisionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrganisationScoped):
    """The egress decision log of your organisations' agents, newest first."""

    queryset = Decision.objects.all()
    serializer_class = DecisionSerializer
    filterset_fields = {
        "agent": ["exact"],
        "allowed": ["exact"],
        "reason": ["exact"],
        "host": ["exact", "endswith"],
        "kind": ["exact"],
        "decided_at": ["gte", "lt"],
    }
    ordering_fields = ["decided_at"]


class EgressTokenSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """An egress token; the secret (``credentials``) is in the answer to its creation only."""

    agent = ScopedRelatedField(queryset=Agent.objects.all())
    ttl = serializers.IntegerField(
        write_only=True, required=False, min_value=60, max_value=30 * 24 * 3600
    )
    credentials = serializers.SerializerMethodField()
    live = serializers.BooleanField(
        source="is_live", read_only=True, help_text="Neither revoked nor expired."
    )

    class Meta:
        model = EgressToken
        fields = [
            "id", "agent", "prefix", "purpose", "created_at", "expires_at", "revoked_at", "live",
            "ttl", "credentials",
        ]  # fmt: skip
        read_only_fields = ["prefix", "created_at", "expires_at", "revoked_at"]

    def get_credentials(self, obj: EgressToken) -> str | None:
        return getattr(obj, "credentials", None)

    def validate_agent(self, agent: Agent) -> Agent:
        if role_of(self.context["request"].user, agent.organisation) != Role.ADMIN:
            raise exceptions.PermissionDenied("Only admins of the agent's organisation may.")
        return agent

    def create(self, validated_data: dict[str, Any]) -> EgressToken:
        ttl = validated_data.get("ttl")
        token, line = services.issue_token(
            validated_data["agent"],
            ttl=timedelta(seconds=ttl) if ttl else None,
            by=self.context["request"].user,
            purpose=validated_data.get("purpose", ""),
        )
        token.credentials = line  # type: ignore[attr-defined]
        return token


class EgressTokenViewSet(OrganisationScopedViewSet):
    """Egress tokens of your agents. Create one to get ``username:token`` once; revoke it."""

    queryset = EgressToken.objects.select_related("agent__organisation")
    serializer_class = EgressTokenSerializer
    http_method_names = ["get", "post", "head", "options"]
    filterset_fields = ["agent"]

    def organisation_of(self, obj: Any) -> Any:
        return obj.agent.organisation

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke the token; a running proxy refuses it within a second."""
        token = self.get_object()  # checks the role: revoking is a change
        services.revoke_tokens([token])
        token.refresh_from_db()
        return Response(self.get_serializer(token).data)
