"""API: egress tokens and the decision log for people; policy and log ingest for runners."""

from datetime import timedelta
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.models import Agent, Role
from agents.roles import role_of
from covey.api import OrganisationScopedViewSet, ScopedRelatedField
from egress import services
from egress.models import Decision, EgressToken
from runners.auth import IsRunner, RunnerTokenAuthentication
from runners.models import Runner


class DecisionSerializer(serializers.ModelSerializer):
    """One allow or deny of the egress proxy."""

    class Meta:
        model = Decision
        fields = [
            "id", "agent", "username", "kind", "host", "port", "address", "allowed", "reason",
            "detail", "bytes_up", "bytes_down", "decided_at", "closed_at", "proxy",
        ]  # fmt: skip
        read_only_fields = fields


class DecisionViewSet(viewsets.ReadOnlyModelViewSet):
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

    def get_queryset(self) -> QuerySet[Decision]:
        return Decision.objects.for_user(self.request.user)


class EgressTokenSerializer(serializers.ModelSerializer):
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


class EgressPolicyView(APIView):
    """For proxies on runners: the egress policy of the runner's organisation.

    Answers 304 when ``If-None-Match`` names the current generation.
    """

    authentication_classes = [RunnerTokenAuthentication]
    permission_classes = [IsRunner]

    @extend_schema(responses={200: dict, 304: None})
    def get(self, request: Request) -> Response:
        runner: Runner = request.auth  # type: ignore[assignment]
        generation = services.policy_fingerprint(runner.organisation_id)
        etag = f'"{generation}"'
        if request.headers.get("If-None-Match") == etag:
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        snapshot = services.build_snapshot(runner.organisation_id)
        return Response(snapshot, headers={"ETag": f'"{snapshot["generation"]}"'})


class DecisionIngestSerializer(serializers.Serializer):
    """A batch of decision events from a proxy."""

    events = serializers.ListField(child=serializers.DictField(), max_length=5000)


class DecisionIngestView(APIView):
    """For proxies on runners: store a batch of decisions in the log."""

    authentication_classes = [RunnerTokenAuthentication]
    permission_classes = [IsRunner]

    @extend_schema(request=DecisionIngestSerializer, responses={201: dict})
    def post(self, request: Request) -> Response:
        serializer = DecisionIngestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        runner: Runner = request.auth  # type: ignore[assignment]
        try:
            count = services.record_decisions(
                serializer.validated_data["events"],
                proxy=runner.name,
                organisation_id=runner.organisation_id,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise serializers.ValidationError({"events": [f"malformed event: {exc!r}"]}) from None
        return Response({"recorded": count}, status=status.HTTP_201_CREATED)
