"""Control-plane tasks of the runs app (beat)."""

from celery import shared_task

from runs import services


@shared_task(name="runs.place_waiting_runs")
def place_waiting_runs() -> int:
    """Place queued runs whose runner has come back (beat, every few seconds)."""
    return services.place_waiting()


@shared_task(name="runs.prune_run_logs", time_limit=600, soft_time_limit=590)
def prune_run_logs() -> int:
    """Delete whole run logs past COVEY_RUN_LOG_RETENTION_DAYS (beat, hourly)."""
    return services.prune_logs()


@shared_task(name="runs.stop_over_budget")
def stop_over_budget(agent_id: int) -> int:
    """Sent by the model gateway when a budget is found used up."""
    return services.stop_over_budget(agent_id)
