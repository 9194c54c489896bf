"""The approvals app."""

from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """What agents ask for (a package, a route out) and what people decide: requests, their
    requesters, and the grants an approval makes (with their expiry)."""

    name = "approvals"
    verbose_name = "Requests and approval"

    def ready(self) -> None:
        from django.contrib import admin

        from approvals import services
        from egress import sources

        # The admin's index says how many requests wait for a decision, first.
        admin.site.index_template = "admin/covey_index.html"
        # The control-plane host's own proxy files sandboxes' requests through these.
        sources.desk_functions.update(file=services.desk_file, status=services.desk_status)
