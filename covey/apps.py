"""The project package as an app: only for its system checks (covey/checks.py)."""

from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class CoveyConfig(AppConfig):
    default = True
    name = "covey"

    def ready(self) -> None:
        from covey import checks  # noqa: F401  (registers the system checks)


class AdminConfig(admin_apps.AdminConfig):
    """Django's admin with covey's site (covey/admin_site.py): members sign in by being members."""

    default = False  # covey's own app is CoveyConfig; INSTALLED_APPS names this one
    default_site = "covey.admin_site.AdminSite"
