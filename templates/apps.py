"""The allowlist templates app."""

from django.apps import AppConfig


class TemplatesConfig(AppConfig):
    """Allowlist templates, shipped as data and editable per installation."""

    name = "templates"
    verbose_name = "Allowlist templates"
