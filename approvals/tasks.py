"""Beat tasks of requests: grants that expired go, and unattended requests expire."""

from celery import shared_task

from approvals import services


@shared_task(name="approvals.expire")
def expire() -> dict[str, int]:
    return {"grants": services.expire_grants(), "requests": services.expire_unattended()}
