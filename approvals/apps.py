"""The approvals app."""

from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """What agents ask for (a package, a route out) and what people decide: requests, their
    requesters, and the grants an approval makes (with their expiry)."""

    name = "approvals"
    verbose_name = "Requests and approval"

    def ready(self) -> None:
        from approvals import services, views
        from egress import sources
        from organisations import webhooks

        # The control-plane host's own proxy files sandboxes' requests through these (a filing
        # validated as a runner's proxy's is, in views).
        sources.desk_functions.update(file=views.desk_file, status=services.desk_status)
        # A retry of request.pending is dropped once the request is decided.
        webhooks.stale_checks["request.pending"] = services.pending_no_longer
