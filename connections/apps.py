"""The connections app."""

from django.apps import AppConfig


class ConnectionsConfig(AppConfig):
    """Connections: organisations' credentials for git hosts, APIs and registries."""

    name = "connections"
