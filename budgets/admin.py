"""Budgets, prices and the ledger in the admin: budgets set through the service (the current
period follows at once), prices as dated rows (a change is a new row), the ledger read-only.
Money is shown by budgets.money (cents, or a small amount's digits; a ledger row and a price
with every digit), and entered without the column's six decimal places."""

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest

from agents.admin import AgentAdmin
from agents.models import Agent
from budgets import alerts, keys, metering, services
from budgets.models import DEFAULT_THRESHOLDS, Budget, Charge, ModelKey, Price, Spend
from budgets.money import dollars, figures
from organisations.admin import PlatformOwned, TenantScoped
from organisations.readonly import ReadOnlyAdmin, ReadOnlyInline


def shown(name: str, description: str, *, exact: bool = False) -> Callable[[Any, Any], str]:
    """An admin column of the amount ``name`` in dollars (budgets.money)."""

    @admin.display(description=description, ordering=name)
    def column(self: Any, obj: Any) -> str:
        return dollars(getattr(obj, name), exact=exact)

    return column


class DollarsField(forms.DecimalField):
    """An amount in US dollars, shown in its field as people write it ('5.00', not the
    column's '5.000000')."""

    def prepare_value(self, value: Any) -> Any:
        return figures(value) if isinstance(value, Decimal) else value


DOLLARS: dict[type[models.Field], dict[str, Any]] = {
    models.DecimalField: {"form_class": DollarsField}
}


class SpendInline(ReadOnlyInline):
    """Every period of the budget, newest first: what was spent against what limit."""

    model = Spend
    ordering = ["-starts_at"]
    fields = (
        "starts_at", "ends_at", "limit_shown", "spent_shown", "reserved_shown", "alerted",
        "exhausted_at",
    )  # fmt: skip
    readonly_fields = fields
    limit_shown = shown("limit", "limit", exact=True)
    spent_shown = shown("spent", "spent", exact=True)
    reserved_shown = shown("reserved", "held by requests under way", exact=True)


ALERTS = ("alert_1", "alert_2", "alert_3")  # the form's three thresholds


def _alert_field(label: str) -> forms.IntegerField:
    return forms.IntegerField(
        label=label, required=False, min_value=1, max_value=1000, widget=forms.NumberInput()
    )


class BudgetForm(forms.ModelForm):
    """A budget; its alert thresholds as three percentages of the amount (an empty one: one
    alert fewer)."""

    user: Any = None  # who is asking (BudgetAdmin.get_form)
    alert_1 = _alert_field("Alert at (%)")
    alert_2 = _alert_field("and at (%)")
    alert_3 = _alert_field("and at (%)")

    class Meta:
        model = Budget
        fields = ["organisation", "agent", "amount", "period"]
        field_classes = {"amount": DollarsField}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        given = self.instance.thresholds if self.instance.pk else DEFAULT_THRESHOLDS
        given = sorted(given)
        for name, value in zip(ALERTS, given, strict=False):
            self.fields[name].initial = value
        # More than three (set through the API) are kept as they are, and said so.
        self.kept = given[len(ALERTS) :]
        self.fields[ALERTS[-1]].help_text = (
            "Percentages of the amount (1 to 1000) at which the organisation's admins (by"
            " email) and its webhook (budget.threshold) are told, once per period; leave one"
            " empty for fewer alerts."
        )
        if self.kept:
            self.fields[ALERTS[-1]].help_text += (
                f" This budget also alerts at {', '.join(map(str, self.kept))} % (set through"
                " the API): kept."
            )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        chosen = [data[name] for name in ALERTS if data.get(name) is not None]
        data["thresholds"] = alerts.check_thresholds([*chosen, *self.kept])
        agent, organisation = data.get("agent"), data.get("organisation")
        if agent is not None and organisation and agent.organisation_id != organisation.pk:
            self.add_error("agent", "The agent is not in this organisation.")
        if self.instance.pk is None and agent is None and organisation is not None:
            if Budget.objects.filter(organisation=organisation, agent=None).exists():
                self.add_error(
                    "organisation",
                    "This organisation has a budget of its own already: change that one.",
                )
            elif not self.user.has_perm("budgets.change_budget"):
                # As in the API: the organisation's cap is the platform's limit on it.
                self.add_error(
                    "agent",
                    "An organisation's own budget is set by the platform team (the 'change"
                    " budget' permission); choose one of its agents.",
                )
        return data


@admin.register(Budget)
class BudgetAdmin(TenantScoped, admin.ModelAdmin):
    form = BudgetForm
    list_display = [
        "__str__", "organisation", "amount_shown", "period", "spent_now", "remaining_now",
    ]  # fmt: skip
    list_filter = ["organisation", "period"]
    list_select_related = ["organisation", "agent"]
    fields = ["organisation", "agent", "amount", "period", ALERTS]
    inlines = [SpendInline]
    amount_shown = shown("amount", "amount")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Not by an organisation, as in the API (its periods are the record); the platform
        # team's deletions (of an organisation, say) take it along.
        return bool(request.user.is_superuser)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is not None and not self.has_change_permission(request, obj):
            # Read only: the amount in dollars, the thresholds on one line.
            return ["organisation", "agent", "amount_shown", "period", "alerts"]
        return super().get_fields(request, obj)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["organisation", "agent"] if obj else []

    @admin.display(description="Alerts at")
    def alerts(self, obj: Budget) -> str:
        return ", ".join(f"{threshold} %" for threshold in obj.thresholds) or "none"

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change, **kwargs)
        form.user = request.user  # type: ignore[attr-defined]
        return form

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # An organisation's own budget is the platform team's (as in the API).
        if obj is not None and obj.agent_id is None:
            return bool(request.user.has_perm("budgets.change_budget"))
        return super().has_change_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: Budget, form: Any, change: bool) -> None:
        owner: Any = obj.agent if obj.agent is not None else obj.organisation
        saved = services.set_budget(
            owner, obj.amount, period=obj.period, thresholds=form.cleaned_data["thresholds"]
        )
        obj.pk, obj.created_at, obj.updated_at = saved.pk, saved.created_at, saved.updated_at
        obj._state.adding = False

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The page's spends in one query, kept on its budgets for the two columns."""
        changelist = super().get_changelist_instance(request)
        spends = metering.current_spends(list(changelist.result_list))
        for budget in changelist.result_list:
            budget.spend_now = spends[budget.pk]
        return changelist

    def _spend(self, obj: Budget) -> Any:
        known = getattr(obj, "spend_now", None)
        return known if known is not None else metering.current_spends([obj])[obj.pk]

    @admin.display(description="Spent this period")
    def spent_now(self, obj: Budget) -> str:
        spend = self._spend(obj)
        spent = dollars(spend.spent)
        return f"{spent} ({dollars(spend.reserved)} held)" if spend.reserved else spent

    @admin.display(description="Remaining")
    def remaining_now(self, obj: Budget) -> str:
        return dollars(max(self._spend(obj).remaining, Decimal(0)))


PRICES = ["input", "cache_write_5m", "cache_write_1h", "cache_read", "output"]


@admin.register(Price)
class PriceAdmin(PlatformOwned, admin.ModelAdmin):
    """Dollars per million tokens. A price in use is not edited: end it (``effective until``)
    and add the new one, so every charge keeps the row it was priced by."""

    list_display = [
        "model", "vendor", *(f"{name}_shown" for name in PRICES), "effective_from",
        "effective_until",
    ]  # fmt: skip
    search_fields = ["model"]
    list_filter = ["vendor", "effective_until"]
    formfield_overrides = DOLLARS
    input_shown = shown("input", "input", exact=True)
    cache_write_5m_shown = shown("cache_write_5m", "cache write (5 min)", exact=True)
    cache_write_1h_shown = shown("cache_write_1h", "cache write (1 h)", exact=True)
    cache_read_shown = shown("cache_read", "cache read", exact=True)
    output_shown = shown("output", "output", exact=True)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        fields = list(super().get_fields(request, obj))
        if obj is None:
            return fields
        # A price in use is read only: its amounts shown in dollars, not as six decimals.
        return [f"{name}_shown" if name in PRICES else name for name in fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return []
        return [
            "vendor", "model", *(f"{name}_shown" for name in PRICES), "effective_from",
            "created_at",
        ]  # fmt: skip

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Charge)
class ChargeAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    """The ledger: one row per model request, never changed."""

    list_display = [
        "at", "agent", "model", "input_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens",
        "cache_read_tokens", "output_tokens", "cost_shown", "outcome",
    ]  # fmt: skip
    fields = [
        "request_id", "organisation", "agent", "run", "model", "input_tokens",
        "cache_write_5m_tokens", "cache_write_1h_tokens", "cache_read_tokens", "output_tokens",
        "cost_shown", "price", "outcome", "started_at", "at",
    ]  # fmt: skip
    readonly_fields = ["cost_shown", "at"]
    cost_shown = shown("cost", "cost", exact=True)  # the ledger's row: every digit
    list_filter = ["organisation", "outcome", "model"]
    list_select_related = ["agent"]
    search_fields = ["request_id", "agent__name", "model"]
    date_hierarchy = "at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Charge]:
        return super().get_queryset(request).select_related("agent", "price")


class ModelKeyForm(forms.ModelForm):
    key = forms.CharField(
        label="API key",
        strip=True,
        widget=forms.PasswordInput(render_value=False),
        help_text="Kept encrypted and never shown again; the gateway sends it for the"
        " organisation's agents, which never hold it. Enter a new one to replace it.",
    )

    class Meta:
        model = ModelKey
        fields = ["organisation", "vendor"]

    def clean_key(self) -> str:
        try:
            return keys.check_model_key(self.cleaned_data.get("key") or "")
        except ValueError as exc:
            raise forms.ValidationError(f"{str(exc)[:1].upper()}{str(exc)[1:]}.") from None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        organisation, vendor = data.get("organisation"), data.get("vendor")
        known = ModelKey.objects.filter(organisation=organisation, vendor=vendor)
        if self.instance.pk is None and organisation is not None and known.exists():
            self.add_error("vendor", "This organisation has a key there already: change it.")
        return data


@admin.register(ModelKey)
class ModelKeyAdmin(TenantScoped, admin.ModelAdmin):
    """Organisations' keys at model vendors: written here, never read back."""

    form = ModelKeyForm
    list_display = ["organisation", "vendor", "shown", "updated_at"]
    list_filter = ["vendor"]
    fields = ["organisation", "vendor", "key", "shown", "updated_at"]
    readonly_fields = ["shown", "updated_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["organisation", "vendor", "shown", "updated_at"] if obj else ["shown", "updated_at"]

    @admin.display(description="Key")
    def shown(self, obj: ModelKey) -> str:
        return f"…{obj.hint}" if obj.hint else "-"

    def save_model(self, request: HttpRequest, obj: ModelKey, form: Any, change: bool) -> None:
        saved = keys.set_model_key(obj.organisation, form.cleaned_data["key"], obj.vendor)
        obj.pk, obj.hint = saved.pk, saved.hint
        obj._state.adding = False


class AgentWithSpendAdmin(AgentAdmin):
    """The agents' admin (agents/admin.py) with what each spent against its budget: budgets
    sit above agents, so they add the column here."""

    list_display = [*AgentAdmin.list_display[:-1], "spend", AgentAdmin.list_display[-1]]
    list_select_related = [*AgentAdmin.list_select_related, "budget"]
    readonly_fields = [*AgentAdmin.readonly_fields[:-2], "spend", *AgentAdmin.readonly_fields[-2:]]

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The page's spends in one query."""
        changelist = super().get_changelist_instance(request)
        budgets = [a.budget for a in changelist.result_list if _budget_of(a) is not None]
        spends = metering.current_spends(budgets)
        for agent in changelist.result_list:
            budget = _budget_of(agent)
            agent.spend_now = spends[budget.pk] if budget is not None else None
        return changelist

    @admin.display(description="Spent (budget)")
    def spend(self, obj: Agent) -> str:
        budget = _budget_of(obj) if obj.pk else None
        if budget is None:
            return "no budget of its own"
        spend = getattr(obj, "spend_now", None) or metering.current_spends([budget])[budget.pk]
        return services.spend_text(budget, spend)


def _budget_of(agent: Agent) -> Budget | None:
    try:
        return agent.budget
    except Budget.DoesNotExist:
        return None


admin.site.unregister(Agent)
admin.site.register(Agent, AgentWithSpendAdmin)
