"""The budgets app."""

from django.apps import AppConfig


class BudgetsConfig(AppConfig):
    """Budgets: what each agent may spend, metered in the proxy."""

    name = "budgets"
