"""The Celery application shared by the control plane and the runners."""

import os
from pathlib import Path
from typing import Any

from celery import Celery

from covey import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")
broker.install()  # filesystem:// whose messages appear whole (covey/broker.py)

app = Celery("covey")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


FOLDERS = ("data_folder_in", "data_folder_out", "processed_folder", "control_folder")


@app.on_after_configure.connect
def _broker_folders(sender: Celery, **kwargs: Any) -> None:
    """The file-system broker's folders, made when a process first uses Celery (kombu makes
    only the control folder itself): the worker, the runner and the web server alike, wherever
    COVEY_VAR_DIR points, without a step of its own."""
    if not str(sender.conf.broker_url or "").startswith("filesystem://"):
        return
    options = sender.conf.broker_transport_options or {}
    for key in FOLDERS:
        if folder := options.get(key):
            Path(folder).mkdir(parents=True, exist_ok=True)
