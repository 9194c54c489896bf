"""Organisations' tasks: webhook deliveries (organisations/webhooks.py)."""

from typing import Any

from celery import shared_task

from organisations import webhooks


@shared_task(name=webhooks.DELIVER, bind=True, max_retries=webhooks.RETRIES, ignore_result=True)
def deliver(
    task: Any, organisation_id: int, event: str, delivery: str, at: str, data: dict[str, Any]
) -> str:
    """One delivery, tried again later while it fails (webhooks.RETRIES times); one that no
    longer holds when a try comes is dropped, never tried again."""
    outcome = webhooks.post(organisation_id, event, delivery, at, data)
    if outcome.startswith("failed") and task.request.retries < webhooks.RETRIES:
        raise task.retry(countdown=10 * 2**task.request.retries)
    return outcome
