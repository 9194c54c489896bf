"""API shapes of runs and their history."""

from typing import Any

from rest_framework import exceptions, serializers

from agents.models import Agent
from covey.api import RefusesUnknownFields
from organisations.api import ScopedRelatedField
from organisations.models import Role
from organisations.roles import role_of
from runs import services
from runs.models import Run, RunEvent


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["status", "detail", "at"]
        read_only_fields = fields


class RunSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """A run: queue one with ``agent`` and ``task``; the rest is what happened to it."""

    agent = ScopedRelatedField(queryset=Agent.objects.select_related("organisation"))
    agent_version = serializers.IntegerField(source="agent_version.number", read_only=True)
    runner: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    created_by: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    workplace = serializers.SerializerMethodField(
        help_text="The workplace version it was queued at: {id, name, version}; null: none."
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
            "workplace",
            "image_id",
            "services",
            "runner",
            "exit_code",
            "log_tail",
            "home_changes",
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

    def to_representation(self, instance: Run) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(instance)
        view = self.context.get("view")
        if getattr(view, "action", None) == "list":  # a page of runs: not every service's log
            data["services"] = [
                {k: v for k, v in service.items() if k != "log"} for service in data["services"]
            ]
        return data

    def get_workplace(self, run: Run) -> dict[str, Any] | None:
        version = run.workplace_version
        if version is None:
            return None
        return {
            "id": version.workplace_id,
            "name": version.config.get("name"),
            "version": version.number,
        }

    def validate_agent(self, agent: Agent) -> Agent:
        # 403, not 400: the agent is visible to this member, who may not start its runs. An
        # agent of another organisation stays a 400 ("does not exist"): that reveals nothing.
        if role_of(self.context["request"].user, agent.organisation) != Role.ADMIN:
            raise exceptions.PermissionDenied(
                f"Your role in {agent.organisation.name!r} does not allow starting runs."
            )
        return agent

    def create(self, validated_data: dict[str, Any]) -> Run:
        return services.queue_run(
            validated_data["agent"], validated_data["task"], by=self.context["request"].user
        )
