"""Periodic egress housekeeping."""

from celery import shared_task

from egress import services


@shared_task(name="egress.prune_decisions", time_limit=600, soft_time_limit=590)
def prune_decisions() -> int:
    """Delete decision log rows past COVEY_EGRESS_DECISION_RETENTION_DAYS."""
    return services.prune_decisions()
