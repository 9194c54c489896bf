"""The project package as an app: only for its system checks (covey/checks.py)."""

from django.apps import AppConfig


class CoveyConfig(AppConfig):
    name = "covey"

    def ready(self) -> None:
        from covey import checks  # noqa: F401  (registers the system checks)
