"""The control plane's housekeeping of home operations (beat)."""

from celery import shared_task

from homes import services


@shared_task(name="homes.prune_operations")
def prune_operations() -> int:
    """Forget operations done an hour ago, and spool files nothing reads any more."""
    return services.prune()
