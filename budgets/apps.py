"""The budgets app."""

from django.apps import AppConfig


class BudgetsConfig(AppConfig):
    """Budgets: what each agent may spend on its model, the prices, and the ledger."""

    name = "budgets"

    def ready(self) -> None:
        from budgets import checks  # noqa: F401 (registers the system check)
