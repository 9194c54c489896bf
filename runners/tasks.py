"""The control plane's own housekeeping of runners (beat). The orders a runner host takes are
not here: its worker (runners/host/worker.py) has them, bound to the host it serves, with no
Django; runners/dispatch.py sends them."""

from celery import shared_task

from runners.probe import service as probes


@shared_task(name="runners.expire_probes")
def expire_probes() -> int:
    """Control plane (beat, every minute): end probes no runner reported on."""
    return probes.expire()
