"""The Celery application shared by the control plane and the runners."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")

app = Celery("covey")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
