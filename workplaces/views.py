"""API resource: workplaces."""

from typing import Any

from rest_framework import serializers

from organisations.api import OrganisationField, OrganisationScopedViewSet
from workplaces.models import Workplace


class WorkplaceSerializer(serializers.ModelSerializer):
    """A workplace: the image an organisation's agents run in."""

    organisation = OrganisationField()

    class Meta:
        model = Workplace
        fields = ["id", "organisation", "name", "image", "description", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def validate_organisation(self, value: Any) -> Any:
        if self.instance is not None and value.pk != self.instance.organisation_id:
            raise serializers.ValidationError("A workplace cannot move to another organisation.")
        return value


class WorkplaceViewSet(OrganisationScopedViewSet):
    """Workplaces of your organisations."""

    queryset = Workplace.objects.select_related("organisation")
    serializer_class = WorkplaceSerializer
    filterset_fields = ["organisation"]
    ordering_fields = ["name", "created_at"]
