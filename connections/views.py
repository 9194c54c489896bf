"""API resources: connections, and the record of the requests agents made with them. A
credential is written, never read: it goes in when the connection is made and with ``rotate``,
and no answer holds it."""

from typing import Any

from django.db import transaction
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from connections import services
from connections.models import CONNECTION_FIELDS, Connection, CredentialedRequest
from covey.api import RefusesUnknownFields
from organisations.api import OrganisationField, OrganisationScoped, OrganisationScopedViewSet

CREDENTIAL_HELP = (
    "The credential: a GitHub App's private key (PEM), a token, or a password. Written once,"
    " kept encrypted, never returned; change it with rotate."
)


class ConnectionSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """An upstream of an organisation and how the gateway authenticates to it; ``host`` is
    what agents' git paths name, ``status`` what the upstream last said of the credential."""

    organisation = OrganisationField()
    secret = serializers.CharField(
        write_only=True, trim_whitespace=False, help_text=CREDENTIAL_HELP, required=False
    )
    paths = serializers.ListField(child=serializers.CharField(), required=False)
    host = serializers.CharField(read_only=True)

    class Meta:
        model = Connection
        fields = [
            "id",
            *CONNECTION_FIELDS,
            "secret",
            "host",
            "secret_set_at",
            "status",
            "status_at",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["secret_set_at", "status", "status_at", "created_at", "updated_at"]
        validators: list[Any] = []  # uniqueness is checked by the service, with field messages

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if self.instance is None:
            if not data.get("secret"):
                raise serializers.ValidationError({"secret": ["give the credential"]})
            return data
        if "secret" in data:
            told = "a credential is changed with rotate, never by an update"
            raise serializers.ValidationError({"secret": [told]})
        if data.get("kind", self.instance.kind) != self.instance.kind:
            told = "a connection keeps its kind: make another"
            raise serializers.ValidationError({"kind": [told]})
        organisation = data.get("organisation", self.instance.organisation)
        if organisation.pk != self.instance.organisation_id:
            told = "a connection cannot move to another organisation"
            raise serializers.ValidationError({"organisation": [told]})
        return data

    def create(self, validated_data: dict[str, Any]) -> Connection:
        return services.create_connection(
            validated_data.pop("organisation"),
            validated_data.pop("name"),
            validated_data.pop("kind"),
            validated_data.pop("secret"),
            by=self.context["request"].user,
            **validated_data,
        )

    def update(self, instance: Connection, validated_data: dict[str, Any]) -> Connection:
        for field in ("organisation", "kind"):
            validated_data.pop(field, None)
        return services.update_connection(
            instance, by=self.context["request"].user, **validated_data
        )


class RotationSerializer(RefusesUnknownFields, serializers.Serializer):
    """A new credential for a connection."""

    secret = serializers.CharField(trim_whitespace=False, help_text=CREDENTIAL_HELP)


class ConnectionViewSet(OrganisationScopedViewSet):
    """Connections of your organisations: upstreams (git hosts, their APIs, registries) and
    their credentials, which agents use through the gateway within their grants. Members read;
    admins make, change, rotate and delete."""

    queryset = Connection.objects.select_related("organisation")
    serializer_class = ConnectionSerializer
    filterset_fields = ["organisation", "kind", "name"]
    ordering_fields = ["name", "created_at"]

    @extend_schema(request=RotationSerializer, responses=ConnectionSerializer)
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, pk: str | None = None) -> Response:
        """Put a new credential in the old one's place; the gateway's next request uses it."""
        connection = self.get_object()
        body = RotationSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        rotated = services.rotate_secret(connection, body.validated_data["secret"], by=request.user)
        return Response(self.get_serializer(rotated).data)

    def perform_destroy(self, instance: Connection) -> None:
        with transaction.atomic():
            services.delete_connection(instance, by=self.request.user)


class CredentialedRequestSerializer(serializers.ModelSerializer):
    """One request an agent made through the gateway under a connection, or tried to:
    ``refused`` says why it did not pass (empty when it did), ``refs`` a push's ref updates."""

    class Meta:
        model = CredentialedRequest
        fields = [
            "id", "organisation", "agent", "run", "connection", "at", "method", "host",
            "repository", "service", "path", "status", "refused", "refs",
        ]  # fmt: skip
        read_only_fields = fields


class RefusedFilter(filters.FilterSet):
    refused = filters.BooleanFilter(
        method="filter_refused", help_text="true: the refused ones only; false: the others."
    )

    class Meta:
        model = CredentialedRequest
        fields = {
            "organisation": ["exact"],
            "agent": ["exact"],
            "run": ["exact"],
            "connection": ["exact"],
            "repository": ["exact"],
            "at": ["gte", "lt"],
        }

    def filter_refused(self, queryset: Any, name: str, value: bool) -> Any:
        return queryset.exclude(refused="") if value else queryset.filter(refused="")


class CredentialedRequestViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, OrganisationScoped
):
    """The record of what your organisations' agents did with connections' credentials,
    newest first; never changed."""

    queryset = CredentialedRequest.objects.all()
    serializer_class = CredentialedRequestSerializer
    filterset_class = RefusedFilter
    ordering_fields = ["at"]
