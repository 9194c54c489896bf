"""The beat schedule names only tasks the workers know."""

import pytest
from django.conf import settings

from covey.celery import app


@pytest.mark.django_db  # the worker's start runs the model checks, which ask the database
def test_every_scheduled_task_is_registered():
    app.loader.import_default_modules()  # what a worker imports at start (autodiscovery)
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "runners.expire_probes" in scheduled
    assert scheduled <= set(app.tasks), scheduled - set(app.tasks)
