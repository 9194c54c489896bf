"""API shapes of organisations."""

from typing import Any

from rest_framework import serializers

from allowlists.fields import AllowlistSerializerField
from organisations import services
from organisations.models import Organisation


class OrganisationSerializer(serializers.ModelSerializer):
    """An organisation and its base allowlist."""

    base_allowlist = AllowlistSerializerField(required=False)

    class Meta:
        model = Organisation
        fields = ["id", "name", "slug", "base_allowlist", "request_expiry_minutes", "created_at"]
        read_only_fields = ["slug", "created_at"]
        # The service says which name is taken, in its own words.
        extra_kwargs: dict[str, dict[str, Any]] = {"name": {"validators": []}}

    def create(self, validated_data: dict[str, Any]) -> Organisation:
        return services.create_organisation(by=self.context["request"].user, **validated_data)

    def update(self, instance: Organisation, validated_data: dict[str, Any]) -> Organisation:
        services.update_organisation(instance, by=self.context["request"].user, **validated_data)
        return instance
