"""Orders to runners, over Celery: each runner consumes its own queue (``Runner.queue``).

An order carries ids, never secrets, with one exception: a renewed runner token, which is
sealed with a key only the runner and the control plane can derive (from the old token's hash,
which the control plane stores and the runner can compute), so the broker never sees it. The
task names are the protocol's (runners/protocol.py); the runner host's worker takes them.
"""

from covey.celery import app
from runners.host.sealing import seal
from runners.models import Runner
from runners.protocol import CANCEL, HOME, LAUNCH, PROBE, RENEW, Order


def send_launch(runner: Runner, run_id: str) -> None:
    app.send_task(LAUNCH, args=Order(runner.pk, run_id).args(), queue=runner.queue)


def send_cancel(runner: Runner, run_id: str) -> None:
    app.send_task(CANCEL, args=Order(runner.pk, run_id).args(), queue=runner.queue)


def send_probe(runner: Runner, probe_id: str) -> None:
    app.send_task(PROBE, args=Order(runner.pk, probe_id).args(), queue=runner.queue)


def send_home(runner: Runner, operation_id: str) -> None:
    """An operation on a home the runner holds (it takes the details from the API)."""
    # Not worth doing once its asker has given up (homes.services.TAKE_SECONDS).
    order = Order(runner.pk, operation_id)
    app.send_task(HOME, args=order.args(), queue=runner.queue, expires=30)


def send_token(runner: Runner, old_token_sha256: str, new_token: str) -> None:
    order = Order(runner.pk, seal(old_token_sha256, new_token))
    app.send_task(RENEW, args=order.args(), queue=runner.queue)
