"""The workplaces app."""

from django.apps import AppConfig


class WorkplacesConfig(AppConfig):
    """Workplaces: the image (and later the companion services) an agent works in."""

    name = "workplaces"
