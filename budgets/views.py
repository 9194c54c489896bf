"""API resources: budgets (with the current period's spend), the ledger of charges, and an
agent's usage."""

from datetime import UTC
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers
from rest_framework.exceptions import PermissionDenied
from rest_framework.exceptions import ValidationError as BadRequest
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.models import Agent
from budgets import metering, services
from budgets.models import Budget, Charge, Period
from covey.api import RefusesUnknownFields
from organisations.api import OrganisationField, OrganisationScoped, ScopedRelatedField


class BudgetSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """A budget: the agent's, or (without ``agent``) its organisation's cap on the sum of its
    agents; ``current`` is the period now: its limit, spent, held by requests under way, and
    remaining, in US dollars."""

    organisation = OrganisationField()
    agent = ScopedRelatedField(queryset=Agent.objects.all(), required=False, allow_null=True)
    period = serializers.ChoiceField(choices=Period.choices, default=Period.MONTHLY)
    thresholds = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=1000), required=False
    )
    current = serializers.SerializerMethodField()

    class Meta:
        model = Budget
        fields = [
            "id", "organisation", "agent", "amount", "period", "thresholds", "current",
            "created_at", "updated_at",
        ]  # fmt: skip
        read_only_fields = ["created_at", "updated_at"]
        validators: list[Any] = []  # one per agent / organisation: set_budget changes it

    def get_current(self, budget: Budget) -> dict[str, Any]:
        # The list's spends come in one query (BudgetViewSet); one budget's in its own.
        known = self.context.get("spends") or metering.current_spends([budget])
        spend = known[budget.pk]
        return {
            "starts_at": spend.starts_at,
            "ends_at": spend.ends_at,
            "limit": str(spend.limit),
            "spent": str(spend.spent),
            "reserved": str(spend.reserved),
            "remaining": str(max(spend.remaining, Decimal(0))),
            "alerted": spend.alerted,  # the thresholds told this period
            "used_up": spend.exhausted_at is not None,
        }

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        agent, organisation = data.get("agent"), data.get("organisation")
        if self.instance is not None:
            moved = organisation is not None and organisation.pk != self.instance.organisation_id
            if moved or ("agent" in data and getattr(agent, "pk", None) != self.instance.agent_id):
                raise BadRequest("a budget stays with its agent or organisation")
        elif (
            agent is not None
            and organisation is not None
            and (agent.organisation_id != organisation.pk)
        ):
            raise BadRequest({"agent": ["the agent is not in this organisation"]})
        else:
            field, found = (
                ("agent", Budget.objects.filter(agent=agent))
                if agent is not None
                else ("organisation", Budget.objects.filter(organisation=organisation, agent=None))
            )
            existing = found.values_list("pk", flat=True).first()
            if existing is not None:  # a second one would change the first, period and all
                raise BadRequest(
                    {
                        field: [
                            f"the {field} has a budget already: change it (PATCH"
                            f" /api/v1/budgets/{existing}/)"
                        ]
                    }
                )
        whole = (self.instance.agent_id is None) if self.instance else agent is None
        if whole and not self.context["request"].user.has_perm("budgets.change_budget"):
            # The organisation's cap is the platform's limit on the tenant, not its own.
            raise PermissionDenied(
                "An organisation's budget is set by the platform team (the"
                " 'budgets.change_budget' permission); its admins set its agents' budgets."
            )
        return data

    def _save(self, data: dict[str, Any], owner: Any) -> Budget:
        try:
            return services.set_budget(
                owner,
                data["amount"],
                period=data.get("period", Period.MONTHLY),
                thresholds=data.get("thresholds"),
            )
        except ValidationError as exc:
            raise BadRequest(exc.message_dict) from None

    def create(self, validated_data: dict[str, Any]) -> Budget:
        owner = validated_data.get("agent") or validated_data["organisation"]
        return self._save(validated_data, owner)

    def update(self, instance: Budget, validated_data: dict[str, Any]) -> Budget:
        data = {
            "amount": instance.amount,
            "period": instance.period,
            "thresholds": instance.thresholds,
            **validated_data,
        }
        return self._save(data, instance.agent or instance.organisation)


class BudgetViewSet(
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.ListModelMixin,
    OrganisationScoped,
):
    """Budgets of your organisations; admins set them (a second budget for the same agent or
    organisation changes the first). Not deleted: their periods are the record."""

    queryset = Budget.objects.select_related("organisation", "agent")
    serializer_class = BudgetSerializer
    filterset_fields = ["organisation", "agent", "period"]
    ordering_fields = ["created_at", "amount"]

    def paginate_queryset(self, queryset: Any) -> Any:
        page = super().paginate_queryset(queryset)
        if page is not None:
            self.spends = metering.current_spends(list(page))
        return page

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "spends": getattr(self, "spends", None)}


class ChargeSerializer(serializers.ModelSerializer):
    price: "serializers.StringRelatedField[Any]" = serializers.StringRelatedField()

    class Meta:
        model = Charge
        fields = [
            "request_id", "organisation", "agent", "run", "model", "input_tokens",
            "cache_write_5m_tokens", "cache_write_1h_tokens", "cache_read_tokens",
            "output_tokens", "cost", "price", "outcome", "at",
        ]  # fmt: skip
        read_only_fields = fields


class ChargeViewSet(mixins.RetrieveModelMixin, mixins.ListModelMixin, OrganisationScoped):
    """The ledger: one row per model request, what it used and cost; never changed."""

    queryset = Charge.objects.select_related("price")
    serializer_class = ChargeSerializer
    filterset_fields = ["organisation", "agent", "run", "model", "outcome"]
    ordering_fields = ["at", "cost"]
    lookup_field = "request_id"


@extend_schema_view(
    get=extend_schema(
        parameters=[
            OpenApiParameter("since", OpenApiTypes.DATETIME, description="from (ISO 8601)"),
            OpenApiParameter("until", OpenApiTypes.DATETIME, description="until, excluded"),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
)
class AgentUsageView(APIView):
    """``GET /api/v1/agents/{id}/usage/``: what the agent spent (``since`` and ``until``, ISO
    times; default: its budget's current period, or the current month), in total and by model,
    and where each budget that applies to it stands now. Members of its organisation read it."""

    permission_classes = [permissions.IsAuthenticated]

    def get(self, request: Request, agent_id: int) -> Response:
        agent = get_object_or_404(Agent.objects.for_user(request.user), pk=agent_id)
        bounds = {}
        for name in ("since", "until"):
            text = request.query_params.get(name)
            if text:
                when = parse_datetime(text)
                if when is None:
                    raise BadRequest(f"{name}: give an ISO 8601 time, e.g. 2026-12-01T00:00:00Z")
                bounds[name] = when if timezone.is_aware(when) else timezone.make_aware(when, UTC)
        if "since" in bounds and "until" in bounds and bounds["since"] >= bounds["until"]:
            raise BadRequest("until: give a time after since")
        return Response(services.usage(agent, **bounds))
