"""gunicorn's settings for every covey control plane (``make run``, the image, the tests and the
benches all start it in this folder, where gunicorn finds this file). Threads, because a home
transfer holds its request for as long as it takes, and the runner streaming it needs another:
with one request per worker, two downloads would stop the whole API."""

import gc
import os

import logs

worker_class = "gthread"
threads = 32  # a home transfer holds two (COVEY_HOME_TRANSFERS caps them at 8)
# gunicorn's control socket (gunicornc) is one path per user, ~/.gunicorn/gunicorn.ctl: a second
# control plane on the host would take it over and remove it when it stops. covey uses none.
control_socket_disable = True

# Its own lines (and, with --access-logfile, one per request) in COVEY_LOG_FORMAT, as covey's.
if os.environ.get("COVEY_LOG_FORMAT", "text") == "json":
    logconfig_dict = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"covey": logs.formatter_config("json")},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "covey"}},
        "loggers": {
            name: {"handlers": ["console"], "level": "INFO", "propagate": False}
            for name in ("gunicorn.error", "gunicorn.access")
        },
    }


def post_worker_init(worker: object) -> None:
    """Load the URL configuration (the admin, the API, every app's views) as a worker boots,
    so that its first request does not wait seconds for those imports."""
    from django.urls import get_resolver

    get_resolver().url_patterns  # noqa: B018
    # What the worker made to boot lives as long as it does: the collector's full passes need
    # not walk it, nor its pass at exit (half a second of each stop).
    gc.freeze()
