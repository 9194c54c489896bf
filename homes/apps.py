"""The homes app."""

from django.apps import AppConfig


class HomesConfig(AppConfig):
    """Homes as people see them from outside: operations ordered to the runner holding each
    home, their answers, and the audit of every change."""

    name = "homes"
