"""API shapes of organisations and their memberships."""

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from allowlists.fields import AllowlistSerializerField
from covey.api import RefusesUnknownFields
from organisations import services, webhooks
from organisations.api import OrganisationField
from organisations.models import Membership, Organisation, Role, Webhook


class OrganisationSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """An organisation and its base allowlist."""

    base_allowlist = AllowlistSerializerField(required=False)

    class Meta:
        model = Organisation
        fields = [
            "id", "name", "slug", "base_allowlist", "request_expiry_minutes", "own_requests",
            "created_at",
        ]  # fmt: skip
        read_only_fields = ["slug", "created_at"]
        # The service says which name is taken, in its own words.
        extra_kwargs: dict[str, dict[str, Any]] = {"name": {"validators": []}}

    def create(self, validated_data: dict[str, Any]) -> Organisation:
        return services.create_organisation(by=self.context["request"].user, **validated_data)

    def update(self, instance: Organisation, validated_data: dict[str, Any]) -> Organisation:
        services.update_organisation(instance, by=self.context["request"].user, **validated_data)
        return instance


class WebhookSerializer(RefusesUnknownFields, serializers.ModelSerializer):
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

    def validate_url(self, value: str) -> str:
        """What the webhook service takes (organisations.webhooks.check_url)."""
        try:
            return webhooks.check_url(value)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from None


class MembershipSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """A user's role in an organisation. Add one with ``organisation``, ``user`` (the
    username) and ``role``; afterwards only the role changes."""

    organisation = OrganisationField(queryset=Organisation.objects.all())
    user: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", queryset=get_user_model().objects.filter(is_active=True)
    )

    class Meta:
        model = Membership
        fields = ["id", "organisation", "user", "role"]
        # The service says who is a member already, in its own words.
        validators: list[Any] = []

    def update(self, instance: Membership, validated_data: dict[str, Any]) -> Membership:
        if validated_data.get("organisation", instance.organisation) != instance.organisation or (
            validated_data.get("user", instance.user) != instance.user
        ):
            raise serializers.ValidationError(
                "a membership's organisation and user do not change: remove it and add another"
            )
        role = validated_data.get("role", instance.role)
        return services.change_role(instance, role, by=self.context["request"].user)

    def create(self, validated_data: dict[str, Any]) -> Membership:
        return services.add_member(
            validated_data["organisation"],
            validated_data["user"],
            validated_data.get("role", Role.VIEWER),
            by=self.context["request"].user,
        )
