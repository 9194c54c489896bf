"""gunicorn's settings for every covey control plane (``make run``, the image, the tests and the
benches all start it in this folder, where gunicorn finds this file). Threads, because a home
transfer holds its request for as long as it takes, and the runner streaming it needs another:
with one request per worker, two downloads would stop the whole API."""

worker_class = "gthread"
threads = 32  # a home transfer holds two (COVEY_HOME_TRANSFERS caps them at 8)
