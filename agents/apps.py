"""The agents app."""

from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """Organisations, their members, agents and agent versions."""

    name = "agents"
