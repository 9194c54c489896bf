"""covey settings: everything comes from the environment, with defaults that let a checkout run.

`make run` needs no configuration at all: SQLite and a file-system Celery broker under `var/`.
Production sets DATABASE_URL, CELERY_BROKER_URL, DJANGO_SECRET_KEY and DJANGO_ALLOWED_HOSTS.
"""

from pathlib import Path

import environ

import logs
from budgets.gateway.config import GatewayConfig
from covey import var
from egress.proxy.config import ProxyConfig
from runners.host import broker
from runners.host.config import HostSettings

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
# The proxy's variables (COVEY_EGRESS_*), read by the proxy's own parser: one parser each.
_proxy = ProxyConfig.from_environment()
# The runner host's variables, read by its own parser (runners/host/config.py): those the
# control plane shares with it (its directory, the broker, the log format...) are taken from it.
_host = HostSettings.from_environment()
VAR_DIR = _host.var_dir


# --- Django core --------------------------------------------------------------------------

# Settings make nothing: without DJANGO_SECRET_KEY the key is the one `python -m covey.var` made
# (make run does); the web server refuses to start with neither (covey/wsgi.py), and processes
# that sign nothing (the worker, runners, the proxy) need none. (The worker does need the
# encryption key below, to sign webhooks.)
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="") or var.secret_key(VAR_DIR)
# Secrets covey reads back (covey/crypto.py) are encrypted with these keys (Fernet; the first
# encrypts, all decrypt); without them, with the one `python -m covey.var` made.
COVEY_ENCRYPTION_KEYS = env.list("COVEY_ENCRYPTION_KEYS", default=[]) or [
    key for key in [var.encryption_key(VAR_DIR)] if key
]
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

# Served over HTTPS (a deployment, behind a proxy that ends TLS): the session and CSRF cookies go
# over HTTPS only and browsers are told to keep to HTTPS (HSTS). The redirect of plain HTTP is
# apart: runners and proxies on the same host may reach web over plain HTTP on a private network.
HTTPS = env.bool("DJANGO_HTTPS", default=False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SESSION_COOKIE_HTTPONLY = True
SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=31_536_000 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=False)
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=False)
if env.bool("DJANGO_BEHIND_TLS_PROXY", default=False):  # it sets X-Forwarded-Proto, and strips it
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
X_FRAME_OPTIONS = "DENY"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'covey.sqlite3'}")}
# A request (or a proxy's poll) keeps its thread's database connection for the next one,
# checked before reuse: opening one costs about as much as the request on PostgreSQL
# (bench/control_plane.py), and about 2 ms of CPU on SQLite (its settings run on every open).
_SQLITE = DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3"
DATABASES["default"]["CONN_MAX_AGE"] = env.int("COVEY_DB_CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if _SQLITE:
    # Several processes write (web workers, the worker, the egress proxy): a transaction takes
    # the write lock when it begins and waits for it, instead of failing "database is locked"
    # when two writers meet halfway.
    # Write-ahead logging: readers never wait for the writer, and a commit is one append to
    # the log (synced at checkpoints, NORMAL: an application that dies loses nothing; a power
    # cut may lose the last commits, as PostgreSQL with synchronous_commit off would).
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        transaction_mode="IMMEDIATE",
        timeout=20,
        init_command="PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "covey.apps.AdminConfig",  # Django's admin on covey's site: members sign in as members
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "simple_history",
    # covey's apps, from the root up (imports point down this list; import-linter keeps it):
    "organisations",
    "templates",
    "workplaces",
    "connections",
    "agents",
    "egress",
    "runners",
    "runs",
    "homes",
    "approvals",
    "budgets",
    "covey",  # the project's own system checks (covey/checks.py)
]

MIDDLEWARE = [
    "covey.middleware.DatabaseUnavailable",  # first: the sessions' and users' look-ups too
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "simple_history.middleware.HistoryRequestMiddleware",
    "covey.middleware.LogIds",
    "covey.middleware.AdminRefusals",
    "covey.middleware.ValueRefused",  # last: the views' own exceptions
]

ROOT_URLCONF = "covey.urls"
WSGI_APPLICATION = "covey.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # covey's own templates: the admin index and its dashboard (covey/dashboard.py).
        "DIRS": [BASE_DIR / "covey" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
            "libraries": {"covey_dashboard": "covey.dashboard"},
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en"
FORMAT_MODULE_PATH = ["covey.formats"]  # times to the second, as covey/display.py writes them
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# collectstatic fills it (make run; the control-plane image at build time, read-only after).
STATIC_ROOT = Path(env.str("COVEY_STATIC_ROOT", default=str(VAR_DIR / "static")))

# Log lines: "text", or one JSON object per line ("json"), with the run's and agent's ids on
# those that concern one (logs/).
COVEY_LOG_FORMAT = logs.check_format(_host.log_format)
logs.install()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"covey": logs.formatter_config(COVEY_LOG_FORMAT)},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "covey"}},
    "root": {"handlers": ["console"], "level": _host.log_level},
    # One line per request to the control plane would drown a runner's own log.
    "loggers": {"httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"}},
}

# --- API ----------------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON as covey keeps it (covey/api.py): NaN, lone surrogates, deep nesting are a 400.
    "DEFAULT_PARSER_CLASSES": [
        "covey.api.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "covey.pagination.BoundedPagination",
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "covey.api.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "covey API",
    "DESCRIPTION": "Govern AI coding agents: organisations, agents, allowlists, runners. What"
    " runner hosts and egress proxies call is documented apart: /api/v1/docs/internal/.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "egress.messages.policy_forms_any_of",
    ],
    "SCHEMA_PATH_PREFIX": "/api/v1",
    # Served from this installation, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Choice sets that share a field name get names of their own (not a hash).
    "ENUM_NAME_OVERRIDES": {
        "RequestKindEnum": "approvals.models.Kind",
        "RunStatusEnum": "runs.models.RunStatus",
        "ProbeStatusEnum": "runners.models.ProbeStatus",
        # The level as the wires carry it (labelled by name) and as a runner's record shows it.
        "IsolationEnum": "egress.environment.Isolation",
        "RunnerIsolationEnum": "runners.models.ISOLATION_CHOICES",
    },
}

# --- Celery -------------------------------------------------------------------------------

CELERY_BROKER_URL = _host.broker_url
if CELERY_BROKER_URL.startswith("filesystem://"):
    # kombu's file-system transport: a broker with no server, for the embedded defaults.
    CELERY_BROKER_TRANSPORT_OPTIONS = broker.transport_options(VAR_DIR)
    # Here, as every process that uses the Celery app reads the settings before it connects
    # (covey/celery.py may not import the runner host: lower apps import it).
    broker.install()
# Celery's workers log through LOGGING above in JSON; in text, with Celery's own format.
CELERY_WORKER_HIJACK_ROOT_LOGGER = COVEY_LOG_FORMAT != "json"
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_TIME_LIMIT = env.int("COVEY_TASK_TIME_LIMIT", default=300)
CELERY_TASK_SOFT_TIME_LIMIT = CELERY_TASK_TIME_LIMIT - 10

# --- covey --------------------------------------------------------------------------------

# The list every new organisation starts with (each organisation can then edit its own).
COVEY_EGRESS_BASE_ALLOWLIST = env.list("COVEY_EGRESS_BASE_ALLOWLIST", default=["api.anthropic.com"])
# Cooperative level: sandboxes are told to use the proxy (bypassable by design).
COVEY_EGRESS_ENFORCE = env.bool("COVEY_EGRESS_ENFORCE", default=True)
# "network": sandboxes sit on an internal network whose only exit is the proxy container.
COVEY_EGRESS_ISOLATION = _host.isolation_level
COVEY_EGRESS_NAMESERVERS = list(_proxy.nameservers)
COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS = list(_proxy.allowed_private_cidrs)

# A runner (built-in or remote) reaches the control plane here, with its runner token.
COVEY_CONTROL_PLANE_URL = _proxy.control_plane_url or "http://127.0.0.1:8000"
COVEY_RUNNER_TOKEN = _proxy.runner_token

# /metrics (Prometheus) answers only this bearer token; unset, it refuses everyone.
COVEY_METRICS_TOKEN = _proxy.metrics_token

# The first superuser's password (`make run` generates and prints one when this is unset).
COVEY_ADMIN_PASSWORD = env.str("COVEY_ADMIN_PASSWORD", default="")

# --- egress proxy ---------------------------------------------------------------------------

# How long an egress token lives unless the caller says otherwise (seconds).
COVEY_EGRESS_TOKEN_TTL = env.int("COVEY_EGRESS_TOKEN_TTL", default=4 * 3600)
# Tunnels held open at once: in total, and by one agent. A full proxy answers 429.
COVEY_EGRESS_MAX_TUNNELS = _proxy.max_tunnels
COVEY_EGRESS_MAX_TUNNELS_PER_AGENT = _proxy.max_tunnels_per_agent
# A client connection that has not sent a whole request head this many seconds after it opened
# (or after its last plain request was answered) is closed: slow clients cannot hold the proxy.
COVEY_EGRESS_HEAD_TIMEOUT = _proxy.head_timeout
# The proxy checks for policy changes this often, and refuses everything once its last good
# answer from the policy source is older than the grace period (fail closed).
COVEY_EGRESS_POLICY_POLL = _proxy.poll
COVEY_EGRESS_POLICY_GRACE = _proxy.grace
# Where a proxy answers /healthz, /readyz and /metrics (HOST:PORT; "": it does not), apart from
# the port agents use.
COVEY_EGRESS_STATUS_LISTEN = _proxy.status_listen
# The policy stream (`manage.py policy_stream`, egress/stream/): where it listens, and the URL
# runner hosts' proxies reach it at ("": not told, and they poll). The web process tells every
# proxy that polls (a header of the policy's answer); a proxy follows the stream from then on.
COVEY_EGRESS_STREAM_LISTEN = env.str("COVEY_EGRESS_STREAM_LISTEN", default="127.0.0.1:8004")
COVEY_EGRESS_STREAM_URL = env.str("COVEY_EGRESS_STREAM_URL", default="")
# Decision log rows older than this are pruned.
COVEY_EGRESS_DECISION_RETENTION_DAYS = env.int("COVEY_EGRESS_DECISION_RETENTION_DAYS", default=30)

# --- runs and runners -----------------------------------------------------------------------

# The image of agents without a workplace: the default workplace (make workplace-image), with
# the Claude runtime.
COVEY_DEFAULT_IMAGE = _host.default_image
# The minimal image the egress probe and the proxy check run in (they need python3 alone).
COVEY_PROBE_IMAGE = _host.check_image
# The control-plane host runs sandboxes itself: one built-in runner per organisation.
COVEY_BUILTIN_RUNNER = env.bool("COVEY_BUILTIN_RUNNER", default=True)
# Runners send a heartbeat this often; one not heard from for COVEY_RUNNER_STALE_SECONDS is
# stale (offline) and gets no new work.
COVEY_RUNNER_HEARTBEAT_SECONDS = _host.heartbeat
COVEY_RUNNER_STALE_SECONDS = env.float("COVEY_RUNNER_STALE_SECONDS", default=30.0)
# What happens to a run whose sandbox vanished (the host rebooted, someone removed it):
# "fail" marks it failed, "retry" queues it again (its home is kept either way).
COVEY_RUN_LOST = env.str("COVEY_RUN_LOST", default="fail")
# The most an agent's home may hold, in MiB, unless the agent says otherwise: a run whose home
# holds more is refused before its sandbox is built.
COVEY_HOME_QUOTA_MB = env.int("COVEY_HOME_QUOTA_MB", default=10 * 1024)
# Homes from outside (homes/): changes while a run of the agent is active are refused (409)
# unless this is true; one upload carries at most this many MiB; transfers between a runner
# and the people asking pass through this folder on the control plane's disk.
COVEY_HOME_WRITES_DURING_RUNS = env.bool("COVEY_HOME_WRITES_DURING_RUNS", default=False)
COVEY_HOME_UPLOAD_MAX_MB = env.int("COVEY_HOME_UPLOAD_MAX_MB", default=4096)
# Home transfers (downloads and uploads) at once on this control plane; more are refused with
# 503 until one ends (each holds two of the web server's threads while it goes).
COVEY_HOME_TRANSFERS = env.int("COVEY_HOME_TRANSFERS", default=8)
COVEY_HOME_SPOOL = Path(env.str("COVEY_HOME_SPOOL", default=str(VAR_DIR / "spool")))
# The egress probe (manage.py egress_probe; runners under isolation run it at start and take no
# work until it passes). Control plane side: the vendor endpoint that must be reachable through
# the proxy (default: the first entry of the organisation's base list) and a name that must be
# refused. Runner host side (ip:port lists, checked here too): what stands for the internet,
# private ranges, the cloud metadata address, outside resolvers and IPv6.
COVEY_EGRESS_PROBE_ALLOWED = env.str("COVEY_EGRESS_PROBE_ALLOWED", default="")
COVEY_EGRESS_PROBE_OFF_LIST = env.str("COVEY_EGRESS_PROBE_OFF_LIST", default="example.com:443")
COVEY_EGRESS_PROBE_INTERNET = list(_host.probe_targets.internet)
COVEY_EGRESS_PROBE_PRIVATE = list(_host.probe_targets.private)
COVEY_EGRESS_PROBE_METADATA = list(_host.probe_targets.metadata)
COVEY_EGRESS_PROBE_RESOLVERS = list(_host.probe_targets.resolvers)
COVEY_EGRESS_PROBE_IPV6 = list(_host.probe_targets.ipv6)
# Whole run logs (and other uploads) are kept here; a run's whole log is deleted this many days
# after the run ended (the run, its history and the tail of its output stay).
MEDIA_ROOT = VAR_DIR / "media"
COVEY_RUN_LOG_RETENTION_DAYS = env.int("COVEY_RUN_LOG_RETENTION_DAYS", default=30)

# Approvers hear of new requests by email, through Django's mail backends: the console backend
# (the web process's output) unless one is configured (EMAIL_URL, e.g. smtp://host:587).
vars().update({k: v for k, v in env.email_url("EMAIL_URL", default="consolemail://").items() if v})
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="covey@localhost")
EMAIL_TIMEOUT = env.int("EMAIL_TIMEOUT", default=10)  # seconds: a stuck mail server holds nothing
# Organisations' webhooks (organisations/webhooks.py) verify their receivers' certificates
# against the system's CAs, or this bundle (a file; an internal CA).
COVEY_WEBHOOK_CA_BUNDLE = env.str("COVEY_WEBHOOK_CA_BUNDLE", default="")
# Receivers must be at public addresses, except in these networks (e.g. 10.20.0.0/16).
COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = env.list("COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS", default=[])
# Budgets (budgets/): their daily, weekly and monthly periods begin at midnight in this zone.
COVEY_BUDGET_TIME_ZONE = env.str("COVEY_BUDGET_TIME_ZONE", default="UTC")
# The model gateway (budgets/gateway, `manage.py model_gateway`): the base URL sandboxes call
# it at ("": none, and sandboxes get no model variables), where it listens, the vendor it
# forwards to and the CAs it trusts for it (a file; "": the system's), the max_tokens it sets on
# a request that has none (every reservation is bounded), and how many ledger calls run at once.
COVEY_MODEL_GATEWAY_URL = env.str("COVEY_MODEL_GATEWAY_URL", default="")
_gateway = GatewayConfig.from_environment()  # the gateway's parser (budgets/gateway/config.py)
COVEY_MODEL_GATEWAY_LISTEN = _gateway.listen
COVEY_MODEL_UPSTREAM = _gateway.upstream
COVEY_OPENAI_UPSTREAM = _gateway.openai_upstream
COVEY_MODEL_CA_BUNDLE = _gateway.ca_bundle
COVEY_GATEWAY_DEFAULT_MAX_TOKENS = _gateway.default_max_tokens
COVEY_GATEWAY_LEDGER_THREADS = _gateway.threads
# The longest a request through the gateway may take, answer included; a reservation still open
# five minutes after that (the gateway died, or its ledger failed at the end) is charged its
# worst case by the worker.
COVEY_GATEWAY_MAX_REQUEST_SECONDS = _gateway.total_timeout

CELERY_BEAT_SCHEDULE = {
    "prune-egress-decisions": {"task": "egress.prune_decisions", "schedule": 3600.0},
    "place-waiting-runs": {"task": "runs.place_waiting_runs", "schedule": 10.0},
    "prune-run-logs": {"task": "runs.prune_run_logs", "schedule": 3600.0},
    "expire-probes": {"task": "runners.expire_probes", "schedule": 60.0},
    "prune-home-operations": {"task": "homes.prune_operations", "schedule": 600.0},
    "expire-requests-and-grants": {"task": "approvals.expire", "schedule": 30.0},
    "settle-stale-reservations": {"task": "budgets.settle_stale", "schedule": 300.0},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# The runner host's own settings (where homes live, its proxy, its network, workplace builds,
# its status address...) are read by runners/host/config.py, not here: the control plane does
# not use them. docs/configuration.md lists them all.
