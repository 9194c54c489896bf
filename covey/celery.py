"""The Celery application shared by the control plane and the runners."""

import gc
import inspect
import os
from contextvars import Token
from pathlib import Path
from typing import Any

from celery import Celery, Task, signals

import logs

# Reading the settings installs filesystem:// whose messages appear whole
# (runners/host/broker.py), before the app connects.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")

app = Celery("covey")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# A task's lines carry its name and the ids among its arguments (a launch's run, an alert's
# agent …); each task runs on one thread, from prerun to postrun.
_bound: dict[str, Token[Any]] = {}


@signals.task_prerun.connect
def _bind_ids(
    task_id: str, task: Task, args: tuple[Any, ...], kwargs: dict[str, Any], **_: Any
) -> None:
    try:
        given = inspect.signature(task.run).bind_partial(*args, **kwargs).arguments
    except TypeError:
        given = {}
    ids = {name: given[name] for name in logs.IDS if name in given}
    _bound[task_id] = logs.bind(task=task.name, **ids)


@signals.task_postrun.connect
def _unbind_ids(task_id: str, **_: Any) -> None:
    if (token := _bound.pop(task_id, None)) is not None:
        logs.unbind(token)


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


@signals.worker_ready.connect
@signals.worker_process_init.connect
def _freeze(**_: Any) -> None:
    """What a worker (and each process of its pool) made to start lives as long as it does:
    the collector's full passes need not walk it, nor its pass at exit."""
    gc.freeze()
