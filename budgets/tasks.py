"""Budgets' tasks: alerts by email (budgets.alerts.tell_reached sends them), and stale
reservations charged."""

from celery import shared_task

from budgets import alerts, metering


@shared_task(name=alerts.ALERT, ignore_result=True)
def alert(spend_id: int, thresholds: list[int], used_up: bool = False) -> int:
    """Email the organisation's admins of thresholds reached; how many were told."""
    return alerts.email_alert(spend_id, thresholds, used_up)


@shared_task(name="budgets.settle_stale", ignore_result=True)
def settle_stale() -> int:
    """Charge reservations the gateway never settled their worst case (every 5 minutes)."""
    return metering.settle_stale()
