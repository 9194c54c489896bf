"""What the commands that serve an aiohttp application share (the model gateway, the policy
stream, the demo forge): reading ``--listen``, and serving until a signal."""

import gc
from typing import Any

from aiohttp import web
from django.core.management.base import CommandError

from allowlists.entries import split_host_port


def listen_address(listen: str) -> tuple[str, int]:
    """``--listen``'s HOST:PORT; CommandError saying what is wrong. A host must be named: never
    every interface by omission."""
    try:
        host, port = split_host_port(listen)
    except ValueError as exc:
        raise CommandError(f"--listen {listen!r}: {exc}") from None
    if not host:
        raise CommandError(f"--listen {listen!r}: name the host (HOST:PORT)")
    return host, port


def serve(app: web.Application, host: str, port: int, *, port_setting: str, **options: Any) -> None:
    """Serve ``app`` until SIGTERM or SIGINT; CommandError naming the address when it cannot
    listen there, and how to choose another (``port_setting``: its variable under make run)."""
    gc.freeze()  # what the command made to start lives as long as it: no collector pass walks it
    try:
        web.run_app(
            app, host=host, port=port, print=None, access_log=None, shutdown_timeout=5, **options
        )
    except OSError as exc:
        raise CommandError(
            f"cannot listen on {host}:{port}: {exc} (another port: --listen, or {port_setting}"
            " under make run)"
        ) from None
