"""The control-plane image's entry point: ``docker run covey:latest ROLE [ARGS]``.

One image serves every role; each waits for what it needs (COVEY_WAIT_SECONDS, 60 by
default) and then becomes its process (exec: signals reach it, its exit code is the
container's):

=========  ===============================================================================
web        migrates, makes the first superuser (``admin``: COVEY_ADMIN_PASSWORD, or a
           password printed once), renews every runner's token, then serves HTTP (gunicorn)
           on COVEY_BIND, 0.0.0.0:8000 by default, with COVEY_WEB_WORKERS workers (2)
worker     the Celery worker with its beat (the schedule), once the migrations are applied
runner     a runner host: the built-in runners with no ARGS (their identities come from the
           web role through the shared COVEY_VAR_DIR), else ``runner`` ARGS (``--config
           /var/lib/covey/runner.json`` for a remote one); no database
proxy      the egress proxy on COVEY_PROXY_LISTEN (0.0.0.0:3128)
gateway    the model gateway on COVEY_MODEL_GATEWAY_LISTEN (0.0.0.0:8002)
stream     the policy stream runner hosts' proxies follow, on COVEY_EGRESS_STREAM_LISTEN
           (0.0.0.0:8004)
migrate    applies the migrations and exits
=========  ===============================================================================

Every role but ``runner`` needs DJANGO_SECRET_KEY and COVEY_ENCRYPTION_KEYS given, the same in
each container. Anything else that names a program (``sh``, ``python manage.py shell``) runs as
given. What cannot be reached is named by its address, never with its password.
"""

import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence

ROLES = ("web", "worker", "runner", "proxy", "gateway", "stream", "migrate")
MANAGE = ["python", "manage.py"]
KEYS = ("DJANGO_SECRET_KEY", "COVEY_ENCRYPTION_KEYS")


class EntrypointError(Exception):
    """What stops a role from starting, said to the person who started it."""


def command(role: str, args: Sequence[str], environ: dict[str, str]) -> list[str]:
    """The program a role becomes."""
    if role == "web":
        return [
            "gunicorn",
            "covey.wsgi",
            "--bind",
            environ.get("COVEY_BIND") or "0.0.0.0:8000",
            "--workers",
            environ.get("COVEY_WEB_WORKERS") or "2",
            "--access-logfile",
            "-",
            f"--forwarded-allow-ips={environ.get('COVEY_FORWARDED_ALLOW_IPS', '')}",
            *args,
        ]
    if role == "worker":
        concurrency = environ.get("COVEY_WORKER_CONCURRENCY") or "2"
        return [
            *["celery", "--app", "covey", "worker", "--beat", "--loglevel", "INFO"],
            *["--concurrency", concurrency, *args],
        ]
    if role == "runner":
        return [*MANAGE, "runner", *(args or ["--builtin"])]
    if role == "proxy":
        listen = environ.get("COVEY_PROXY_LISTEN") or "0.0.0.0:3128"
        return [*MANAGE, "egress_proxy", "--listen", listen, *args]
    if role == "gateway":
        listen = environ.get("COVEY_MODEL_GATEWAY_LISTEN") or "0.0.0.0:8002"
        return [*MANAGE, "model_gateway", "--listen", listen, *args]
    if role == "stream":
        listen = environ.get("COVEY_EGRESS_STREAM_LISTEN") or "0.0.0.0:8004"
        return [*MANAGE, "policy_stream", "--listen", listen, *args]
    raise EntrypointError(f"no role {role!r}")


def wait(what: str, ready: Callable[[], str], seconds: float, pause: float = 1.0) -> None:
    """Ask ``ready`` (which returns "" when ready, else why not) until it is, for ``seconds``
    at most; then fail with its last answer."""
    deadline = time.monotonic() + seconds
    said = ""
    while True:
        why = ready()
        if not why:
            if said:
                print(f"covey: {what} is ready", file=sys.stderr, flush=True)
            return
        if time.monotonic() >= deadline:
            raise EntrypointError(f"{what} is not ready after {seconds:g} s: {why}")
        if why != said:
            print(f"covey: waiting for {what}: {why}", file=sys.stderr, flush=True)
            said = why
        time.sleep(pause)


def migrations_applied() -> str:
    from django.db import Error, connection
    from django.db.migrations.executor import MigrationExecutor

    from covey.health import database_problem

    if why := database_problem():
        return why
    try:
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Error as exc:
        connection.close()
        return f"cannot read the applied migrations ({exc})"
    return f"{len(plan)} migration(s) not applied yet (the web role applies them)" if plan else ""


def missing_keys(role: str, environ: dict[str, str]) -> list[str]:
    """The keys a role that reads the database needs given. A container's generated ones
    would differ from its neighbours' and go with it, and with the encryption key what it
    encrypted (the organisations' model keys): refused rather than lost."""
    if role == "runner":
        return []
    return [name for name in KEYS if not environ.get(name)]


def prepare(role: str, environ: dict[str, str]) -> None:
    """What a role waits for and does before it becomes its program."""
    if missing := missing_keys(role, environ):
        raise EntrypointError(
            f"{' and '.join(missing)} not set: every process of an installation needs the same"
            " keys, made once (scripts/compose-env writes them into .env)"
        )
    import django

    from covey import var

    var.prepare(var.default_var_dir())  # the secret and encryption keys when not given
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")
    django.setup()
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.db import connections

    from covey.health import broker_problem, database_problem

    seconds = float(environ.get("COVEY_WAIT_SECONDS") or 60)
    if role == "web":
        try:  # covey's deployment checks (covey/checks.py), before anything is changed
            call_command("check", deploy=True, tags=["covey"], fail_level="ERROR")
        except SystemCheckError as exc:
            raise EntrypointError(f"the settings are not fit to serve: {exc}") from None
    if role in ("web", "migrate"):
        wait("the database", database_problem, seconds)
        call_command("migrate", interactive=False, verbosity=1)
    if role == "web":
        call_command("ensure_admin")
        call_command("renew_runner_tokens")
    if role in ("worker", "proxy", "gateway", "stream"):
        wait("the database", migrations_applied, seconds)
    if role in ("web", "worker", "runner"):
        wait("the broker", broker_problem, seconds)
    connections.close_all()


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if environ is None else environ)
    if not argv:
        argv = ["web"]
    role, args = argv[0], argv[1:]
    if role not in ROLES:
        if "/" in role or shutil.which(role):
            os.execvp(role, argv)  # noqa: S606 - what the container was asked to run
        roles = ", ".join(ROLES)
        print(f"covey: {role!r} is no role ({roles}) nor a program here", file=sys.stderr)
        return 2
    try:
        prepare(role, environ)
    except EntrypointError as exc:
        print(f"covey: {role}: {exc}", file=sys.stderr)
        return 1
    if role == "migrate":
        return 0
    program = command(role, args, environ)
    sys.stdout.flush()
    os.execvp(program[0], program)  # noqa: S606
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
