"""API resource: workplaces, with their versions."""

from typing import Any

from rest_framework import serializers

from covey.api import RefusesUnknownFields
from covey.versions import versions_actions
from organisations.api import OrganisationField, OrganisationScopedViewSet
from workplaces import config, services
from workplaces.models import WORKPLACE_FIELDS, Workplace, WorkplaceVersion


class WorkplaceSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """A workplace: base image, packages per ecosystem, companion services and a default
    command; ``version`` is the number of its current version."""

    organisation = OrganisationField()
    packages = serializers.JSONField(
        required=False, help_text=f"{config.PACKAGES_RULE}. Installed in an image built once."
    )
    services = serializers.JSONField(
        required=False,
        help_text="Companion services, each reachable from the sandbox by its name: name,"
        " image, environment, command, ready (command, start_period, interval, timeout in"
        f" seconds), cpus, memory_mb. E.g. {config.SERVICES_EXAMPLE}",
    )
    runtime_command = serializers.JSONField(
        required=False, help_text="A list of arguments; empty: the Claude runtime on the task."
    )

    class Meta:
        model = Workplace
        fields = ["id", "organisation", *WORKPLACE_FIELDS, "version", "created_at", "updated_at"]
        read_only_fields = ["version", "created_at", "updated_at"]
        validators: list[Any] = []  # uniqueness is checked by the service, with field messages

    def validate_organisation(self, value: Any) -> Any:
        if self.instance is not None and value.pk != self.instance.organisation_id:
            raise serializers.ValidationError("A workplace cannot move to another organisation.")
        return value

    def create(self, validated_data: dict[str, Any]) -> Workplace:
        organisation = validated_data.pop("organisation")
        return services.create_workplace(
            organisation,
            validated_data.pop("name"),
            validated_data.pop("image"),
            by=self.context["request"].user,
            **validated_data,
        )

    def update(self, instance: Workplace, validated_data: dict[str, Any]) -> Workplace:
        validated_data.pop("organisation", None)
        return services.update_workplace(
            instance, by=self.context["request"].user, **validated_data
        )


class WorkplaceVersionSerializer(serializers.ModelSerializer):
    """One version of a workplace's configuration and what changed from the one before."""

    created_by: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )

    class Meta:
        model = WorkplaceVersion
        fields = ["number", "config", "changes", "created_by", "reason", "created_at"]
        read_only_fields = fields


class WorkplaceViewSet(
    versions_actions(WorkplaceVersionSerializer, "Workplace"),  # type: ignore[misc]
    OrganisationScopedViewSet,
):
    """Workplaces of your organisations. Every change to one creates a new numbered version."""

    queryset = Workplace.objects.select_related("organisation")
    serializer_class = WorkplaceSerializer
    filterset_fields = ["organisation"]
    ordering_fields = ["name", "created_at"]
