"""API shapes of organisations."""

from typing import Any

from rest_framework import serializers

from allowlists.fields import AllowlistSerializerField
from organisations import services
from organisations.models import Organisation, Webhook


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


class WebhookSerializer(serializers.ModelSerializer):
    """An organisation's webhook. ``secret`` (the signing secret) is in the answer once: when
    it was made (the first PUT, or one with ``new_secret``)."""

    new_secret = serializers.BooleanField(
        write_only=True, required=False, default=False, help_text="Make a new signing secret."
    )

    class Meta:
        model = Webhook
        fields = [
            "url", "new_secret", "created_at", "secret_made_at", "last_delivery",
            "last_delivery_at",
        ]  # fmt: skip
        read_only_fields = ["created_at", "secret_made_at", "last_delivery", "last_delivery_at"]
