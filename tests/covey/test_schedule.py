"""The beat schedule names only tasks the workers know."""

from django.conf import settings

from covey.celery import app


def test_every_scheduled_task_is_registered():
    app.loader.import_default_modules()  # what a worker imports at start (autodiscovery)
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "runners.expire_probes" in scheduled
    assert scheduled <= set(app.tasks), scheduled - set(app.tasks)
