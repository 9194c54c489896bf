"""API shapes of agents and their versions."""

from typing import Any

from rest_framework import serializers

from agents import services
from agents.models import AGENT_FIELDS, COMMAND_RULE, Agent, AgentVersion, is_command
from allowlists.fields import AllowlistSerializerField
from connections.grants import EXAMPLE
from covey.api import RefusesUnknownFields
from organisations.api import OrganisationField, ScopedRelatedField
from organisations.models import Organisation
from templates.models import AllowlistTemplate
from workplaces.models import Workplace


class CommandField(serializers.ListField):
    """A command as a list of argument strings (no shell: give ``sh -c`` for one)."""

    default_error_messages = {"not_a_list": COMMAND_RULE}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.CharField(trim_whitespace=False), **kwargs)
        self.help_text = f"The command the sandbox runs. {COMMAND_RULE}"

    def to_internal_value(self, data: Any) -> list[str]:
        if not is_command(data):
            self.fail("not_a_list")
        return list(super().to_internal_value(data))


class AgentSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """An agent's current configuration; ``version`` is the number of the current version."""

    organisation = OrganisationField()
    templates = serializers.SlugRelatedField(
        many=True,
        slug_field="slug",
        queryset=AllowlistTemplate.objects.all(),
        required=False,
        error_messages={"does_not_exist": "There is no allowlist template {slug_name}={value!r}."},
    )
    allowlist = AllowlistSerializerField(required=False)
    credential_grants = serializers.JSONField(
        required=False,
        help_text="What it may do with the organisation's connections: a list of grants, each"
        f" over one connection, with its defaults filled in when saved. E.g. {EXAMPLE}",
    )
    required_labels = serializers.ListField(child=serializers.CharField(), required=False)
    workplace = ScopedRelatedField(
        queryset=Workplace.objects.all(), allow_null=True, required=False
    )
    runtime_command = CommandField(required=False)
    home_runner = ScopedRelatedField(
        # Runners build on agents: the model names the relation, this app imports no runner.
        queryset=Agent._meta.get_field("home_runner").related_model._default_manager.all(),
        allow_null=True,
        required=False,
        help_text="Where its home is; runs go there. Set null to let the next run choose again.",
    )

    home_usage = serializers.SerializerMethodField(
        help_text="What its home held when its runner last measured it (at the start and end of"
        " each run), against its quota; bytes, files and measured_at are null until then."
    )

    class Meta:
        model = Agent
        fields = [
            "id",
            "organisation",
            *AGENT_FIELDS,
            "home_usage",
            "version",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["slug", "version", "created_at", "updated_at"]
        validators: list[Any] = []  # uniqueness is checked by the service, with field messages

    def get_home_usage(self, agent: Agent) -> dict[str, Any]:
        return {
            "bytes": agent.home_bytes,
            "files": agent.home_files,
            "quota_bytes": agent.home_quota_bytes,
            "measured_at": agent.home_measured_at,
        }

    def validate_organisation(self, value: Organisation) -> Organisation:
        if self.instance is not None and value.pk != self.instance.organisation_id:
            raise serializers.ValidationError("An agent cannot move to another organisation.")
        return value

    def create(self, validated_data: dict[str, Any]) -> Agent:
        organisation = validated_data.pop("organisation")
        name = validated_data.pop("name")
        return services.create_agent(
            organisation, name, by=self.context["request"].user, **validated_data
        )

    def update(self, instance: Agent, validated_data: dict[str, Any]) -> Agent:
        validated_data.pop("organisation", None)
        return services.update_agent(instance, by=self.context["request"].user, **validated_data)


class AgentVersionSerializer(serializers.ModelSerializer):
    """One version of an agent's configuration and what changed from the one before."""

    created_by: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )

    class Meta:
        model = AgentVersion
        fields = ["number", "config", "changes", "created_by", "reason", "created_at"]
        read_only_fields = fields
