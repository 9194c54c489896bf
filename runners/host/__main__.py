"""``python -m runners.host``: a runner host, with no database and no Django.

Serves the remote runner registered in ``--config`` (``manage.py runner_register`` writes it),
or with ``--builtin`` the control-plane host's built-in runners (their identities are in
COVEY_VAR_DIR). Everything else comes from the environment (``HostSettings.from_environment``:
the COVEY_* variables in docs/configuration.md). ``manage.py runner`` runs the same.
"""

import argparse
import sys
from pathlib import Path

import logs
from runners.host.config import HostSettings
from runners.host.process import HostError, Options, serve


def parser(prog: str = "python -m runners.host") -> argparse.ArgumentParser:
    """The command line, shared with ``manage.py runner``."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner host's options, on ``parser``."""
    parser.add_argument("--builtin", action="store_true", help="Serve the built-in runners.")
    parser.add_argument(
        "--config",
        default=None,
        help="The remote runner's file from runner_register (URL, id, token); default"
        " runner.json in COVEY_VAR_DIR.",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="Orders at once.")
    parser.add_argument(
        "--remove-sandboxes-at-exit",
        action="store_true",
        help="At exit, remove every sandbox, running or not (make run's Ctrl-C); without"
        " it, runs go on and the runner takes them up again when it restarts.",
    )


def options(given: argparse.Namespace | dict) -> Options:
    """What the parsed command line asks for."""
    values = vars(given) if isinstance(given, argparse.Namespace) else given
    return Options(
        builtin=values["builtin"],
        config=Path(values["config"]) if values["config"] else None,
        concurrency=values["concurrency"],
        remove_sandboxes_at_exit=values["remove_sandboxes_at_exit"],
    )


def main(argv: list[str] | None = None) -> int:
    """Run the runner host; the exit status (2: it cannot start as asked)."""
    args = parser().parse_args(argv)
    try:
        settings = HostSettings.from_environment()
        logs.configure(logs.check_format(settings.log_format), settings.log_level)
        serve(settings, options(args), lambda line: print(line, flush=True))
    except (HostError, ValueError, OSError) as exc:
        print(f"covey runner: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
