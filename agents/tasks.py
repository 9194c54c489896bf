"""Control-plane tasks of the agents app."""

from celery import shared_task

from agents import runs


@shared_task(name="agents.place_waiting_runs")
def place_waiting_runs() -> int:
    """Place queued runs whose runner has come back (beat, every few seconds)."""
    return runs.place_waiting()


@shared_task(name="agents.prune_run_logs", time_limit=600, soft_time_limit=590)
def prune_run_logs() -> int:
    """Delete whole run logs past COVEY_RUN_LOG_RETENTION_DAYS (beat, hourly)."""
    return runs.prune_logs()
