"""The organisations app: the root every other app builds on."""

from django.apps import AppConfig


class OrganisationsConfig(AppConfig):
    """Organisations, members and roles, and tenancy scoping."""

    name = "organisations"
