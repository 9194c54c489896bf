"""``python -m egress.proxy --listen HOST:PORT``: the proxy of a runner host, with no database.

Policy comes from the control plane (``COVEY_CONTROL_PLANE_URL``: polled, or followed on the
policy stream its answers name) with the runner's token
(``COVEY_RUNNER_TOKEN``, or ``--runner-config``: the runner's file, re-read when a renewal
rewrites it). The egress image runs this.
"""

import argparse
import os
import socket
import sys

import logs
from egress.proxy.config import ProxyConfig
from egress.proxy.control_plane import remote_source
from egress.proxy.desk import Desk
from egress.proxy.server import ProxyError, parse_listen, serve


def main(argv: list[str] | None = None) -> int:
    """Run the proxy; the exit status (2: it cannot start as asked)."""
    parser = argparse.ArgumentParser(prog="python -m egress.proxy", description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept agents on.")
    parser.add_argument("--control-plane", help="Its URL (default COVEY_CONTROL_PLANE_URL).")
    parser.add_argument("--runner-token", help="The runner token (default COVEY_RUNNER_TOKEN).")
    parser.add_argument("--runner-config", help="The runner's file (URL and token).")
    parser.add_argument("--name", default="", help="This proxy's name in the decision log.")
    parser.add_argument("--verbose", action="store_true", help="mitmproxy's own log too.")
    args = parser.parse_args(argv)
    try:
        logs.configure(
            os.environ.get("COVEY_LOG_FORMAT", "text"), os.environ.get("COVEY_LOG_LEVEL", "INFO")
        )
        config = ProxyConfig.from_environment()
        _, port = parse_listen(args.listen)
        source = remote_source(config, args.control_plane, args.runner_token, args.runner_config)
        serve(
            config,
            args.listen,
            args.name or f"{socket.gethostname()}:{port}",
            source,
            source.post_decisions,
            where=source.url,
            say=lambda line: print(line, flush=True),
            verbose=args.verbose,
            desk=Desk(source.file_request, source.request_status),
            stream=source,
        )
    except (ProxyError, ValueError, OSError) as exc:
        print(f"covey egress proxy: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
