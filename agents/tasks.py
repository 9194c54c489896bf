"""Control-plane tasks of the agents app."""

from celery import shared_task

from agents import runs


@shared_task(name="agents.place_waiting_runs")
def place_waiting_runs() -> int:
    """Place queued runs whose runner has come back (beat, every few seconds)."""
    return runs.place_waiting()
