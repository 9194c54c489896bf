"""API shapes of organisations, agents, agent versions and runs."""

from typing import Any

from rest_framework import exceptions, serializers

from agents import runs, services
from agents.models import AGENT_FIELDS, Agent, AgentVersion, Organisation, Role, Run, RunEvent
from agents.roles import role_of
from covey.api import OrganisationField, ScopedRelatedField
from egress.fields import AllowlistSerializerField
from runners.models import Runner
from templates.models import AllowlistTemplate
from workplaces.models import Workplace


class OrganisationSerializer(serializers.ModelSerializer):
    """An organisation and its base allowlist."""

    base_allowlist = AllowlistSerializerField(required=False)

    class Meta:
        model = Organisation
        fields = ["id", "name", "slug", "base_allowlist", "created_at"]
        read_only_fields = ["slug", "created_at"]
        # The service says which name is taken, in its own words.
        extra_kwargs: dict[str, dict[str, Any]] = {"name": {"validators": []}}

    def create(self, validated_data: dict[str, Any]) -> Organisation:
        return services.create_organisation(by=self.context["request"].user, **validated_data)

    def update(self, instance: Organisation, validated_data: dict[str, Any]) -> Organisation:
        services.update_organisation(instance, by=self.context["request"].user, **validated_data)
        return instance


COMMAND_HELP = (
    'a JSON list of arguments, e.g. ["sh", "-c", "echo hi"] (empty: the Claude runtime on the task)'
)


class CommandField(serializers.ListField):
    """A command as a list of argument strings (no shell: give ``sh -c`` for one)."""

    default_error_messages = {"not_a_list": f"Give the command as {COMMAND_HELP}."}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.CharField(trim_whitespace=False), **kwargs)
        self.help_text = f"The command the sandbox runs: {COMMAND_HELP}."

    def to_internal_value(self, data: Any) -> list[str]:
        if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
            self.fail("not_a_list")
        return list(super().to_internal_value(data))


class AgentSerializer(serializers.ModelSerializer):
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
    required_labels = serializers.ListField(child=serializers.CharField(), required=False)
    workplace = ScopedRelatedField(
        queryset=Workplace.objects.all(), allow_null=True, required=False
    )
    runtime_command = CommandField(required=False)
    home_runner = ScopedRelatedField(
        queryset=Runner.objects.all(),
        allow_null=True,
        required=False,
        help_text="Where its home is; runs go there. Set null to let the next run choose again.",
    )

    class Meta:
        model = Agent
        fields = ["id", "organisation", *AGENT_FIELDS, "version", "created_at", "updated_at"]
        read_only_fields = ["slug", "version", "created_at", "updated_at"]
        validators: list[Any] = []  # uniqueness is checked by the service, with field messages

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
        slug_field="username", read_only=True
    )

    class Meta:
        model = AgentVersion
        fields = ["number", "config", "changes", "created_by", "created_at"]
        read_only_fields = fields


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["status", "detail", "at"]
        read_only_fields = fields


class RunSerializer(serializers.ModelSerializer):
    """A run: queue one with ``agent`` and ``task``; the rest is what happened to it."""

    agent = ScopedRelatedField(queryset=Agent.objects.select_related("organisation"))
    agent_version = serializers.IntegerField(source="agent_version.number", read_only=True)
    runner: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    created_by: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    events = RunEventSerializer(many=True, read_only=True)

    class Meta:
        model = Run
        fields = [
            "id",
            "agent",
            "task",
            "status",
            "status_detail",
            "agent_version",
            "runner",
            "exit_code",
            "log_tail",
            "timeout",
            "created_by",
            "created_at",
            "placed_at",
            "started_at",
            "finished_at",
            "cancel_requested_at",
            "events",
        ]
        read_only_fields = [f for f in fields if f not in ("agent", "task")]

    def validate_agent(self, agent: Agent) -> Agent:
        # 403, not 400: the agent is visible to this member, who may not start its runs. An
        # agent of another organisation stays a 400 ("does not exist"): that reveals nothing.
        if role_of(self.context["request"].user, agent.organisation) != Role.ADMIN:
            raise exceptions.PermissionDenied(
                f"Your role in {agent.organisation.name!r} does not allow starting runs."
            )
        return agent

    def create(self, validated_data: dict[str, Any]) -> Run:
        return runs.queue_run(
            validated_data["agent"], validated_data["task"], by=self.context["request"].user
        )
