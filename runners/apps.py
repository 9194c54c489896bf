"""The runners app."""

from django.apps import AppConfig


class RunnersConfig(AppConfig):
    """Runners: hosts that build and run sandboxes, placed by labels."""

    name = "runners"
