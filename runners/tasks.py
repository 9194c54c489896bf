"""Orders a runner host takes from its queue (see runners.dispatch for who sends them), and
the control plane's own housekeeping of runners (beat).

Orders act for the host this process runs (``manage.py runner``); a launch is acknowledged only
once done, so a worker killed mid-launch gets it again (launching is idempotent per run).
"""

from celery import shared_task

from runners import dispatch
from runners.host import runner as host
from runners.host.client import ControlPlaneError
from runners.probe import service as probes

# The control plane may be restarting: try again a few times, a little later each time.
RETRY = {"autoretry_for": (ControlPlaneError,), "retry_backoff": 1, "max_retries": 6}


@shared_task(name=dispatch.LAUNCH, acks_late=True, reject_on_worker_lost=True, **RETRY)
def launch(runner_id: int, run_id: str) -> None:
    host.current().launch(runner_id, run_id)


@shared_task(name=dispatch.CANCEL, acks_late=True, reject_on_worker_lost=True, **RETRY)
def cancel(runner_id: int, run_id: str) -> None:
    host.current().cancel(runner_id, run_id)


@shared_task(name=dispatch.RENEW, acks_late=True, reject_on_worker_lost=True)
def renew_token(runner_id: int, sealed: str) -> None:
    host.current().renew_token(runner_id, sealed)


@shared_task(name=dispatch.PROBE, acks_late=True, reject_on_worker_lost=True, **RETRY)
def probe(runner_id: int, probe_id: str) -> None:
    host.current().probe(runner_id, probe_id)


@shared_task(name=dispatch.HOME)
def home(runner_id: int, operation_id: str) -> None:
    # Not acknowledged late: the person asking waits seconds, not for a redelivery.
    host.current().home(runner_id, operation_id)


@shared_task(name="runners.expire_probes")
def expire_probes() -> int:
    """Control plane (beat, every minute): end probes no runner reported on."""
    return probes.expire()
