"""Budgets, prices and the ledger in the admin: budgets set through the service (the current
period follows at once), prices as dated rows (a change is a new row), the ledger read-only."""

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from agents.admin import AgentAdmin
from agents.models import Agent
from budgets import services
from budgets.models import Budget, Charge, ModelKey, Price, Spend
from organisations.admin import TenantScoped


class SpendInline(admin.TabularInline):
    """Every period of the budget, newest first: what was spent against what limit."""

    model = Spend
    extra = 0
    can_delete = False
    ordering = ["-starts_at"]
    fields = ["starts_at", "ends_at", "limit", "spent", "reserved", "alerted"]
    readonly_fields = ["starts_at", "ends_at", "limit", "spent", "reserved", "alerted"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class BudgetForm(forms.ModelForm):
    user: Any = None  # who is asking (BudgetAdmin.get_form)

    class Meta:
        model = Budget
        fields = ["organisation", "agent", "amount", "period", "thresholds"]

    def clean_thresholds(self) -> list[int]:
        try:
            return services.check_thresholds(self.cleaned_data.get("thresholds"))
        except ValueError as exc:
            raise forms.ValidationError(f"{str(exc)[:1].upper()}{str(exc)[1:]}.") from None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
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
    list_display = ["__str__", "organisation", "amount", "period", "spent_now", "remaining_now"]
    list_filter = ["organisation", "period"]
    list_select_related = ["organisation", "agent"]
    fields = ["organisation", "agent", "amount", "period", "thresholds"]
    inlines = [SpendInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["organisation", "agent"] if obj else []

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
            owner, obj.amount, period=obj.period, thresholds=list(obj.thresholds or [])
        )
        obj.pk, obj.created_at, obj.updated_at = saved.pk, saved.created_at, saved.updated_at
        obj._state.adding = False

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The page's spends in one query, kept on its budgets for the two columns."""
        changelist = super().get_changelist_instance(request)
        spends = services.current_spends(list(changelist.result_list))
        for budget in changelist.result_list:
            budget.spend_now = spends[budget.pk]
        return changelist

    def _spend(self, obj: Budget) -> Any:
        known = getattr(obj, "spend_now", None)
        return known if known is not None else services.current_spends([obj])[obj.pk]

    @admin.display(description="Spent this period")
    def spent_now(self, obj: Budget) -> str:
        spend = self._spend(obj)
        return f"${spend.spent} (${spend.reserved} held)" if spend.reserved else f"${spend.spent}"

    @admin.display(description="Remaining")
    def remaining_now(self, obj: Budget) -> str:
        return f"${max(self._spend(obj).remaining, 0)}"


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    """Dollars per million tokens. A price in use is not edited: end it (``effective until``)
    and add the new one, so every charge keeps the row it was priced by."""

    list_display = [
        "model", "vendor", "input", "cache_write_5m", "cache_write_1h", "cache_read", "output",
        "effective_from", "effective_until",
    ]  # fmt: skip
    search_fields = ["model"]
    list_filter = ["vendor", "effective_until"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return []
        return [
            "vendor", "model", "input", "cache_write_5m", "cache_write_1h", "cache_read",
            "output", "effective_from", "created_at",
        ]  # fmt: skip

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Charge)
class ChargeAdmin(TenantScoped, admin.ModelAdmin):
    """The ledger: one row per model request, never changed."""

    list_display = [
        "at", "agent", "model", "input_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens",
        "cache_read_tokens", "output_tokens", "cost", "outcome",
    ]  # fmt: skip
    list_filter = ["organisation", "outcome", "model"]
    list_select_related = ["agent"]
    search_fields = ["request_id", "agent__name", "model"]
    date_hierarchy = "at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Charge]:
        return super().get_queryset(request).select_related("agent", "price")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
            return services.check_model_key(self.cleaned_data.get("key") or "")
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
        saved = services.set_model_key(obj.organisation, form.cleaned_data["key"], obj.vendor)
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
        spends = services.current_spends(budgets)
        for agent in changelist.result_list:
            budget = _budget_of(agent)
            agent.spend_now = spends[budget.pk] if budget is not None else None
        return changelist

    @admin.display(description="Spent (budget)")
    def spend(self, obj: Agent) -> str:
        budget = _budget_of(obj) if obj.pk else None
        if budget is None:
            return "no budget of its own"
        spend = getattr(obj, "spend_now", None) or services.current_spends([budget])[budget.pk]
        return services.spend_text(budget, spend)


def _budget_of(agent: Agent) -> Budget | None:
    try:
        return agent.budget
    except Budget.DoesNotExist:
        return None


admin.site.unregister(Agent)
admin.site.register(Agent, AgentWithSpendAdmin)
