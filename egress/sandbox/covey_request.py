#!/usr/bin/env python3
"""covey-request: ask for a route or a package from inside a sandbox, and follow the answer.

    covey-request egress HOST[:PORT] --reason "why" [--wait SECONDS]
    covey-request package ECOSYSTEM NAME[=VERSION] --reason "why" [--wait SECONDS]
    covey-request status ID [--wait SECONDS]

It goes through the sandbox's egress proxy (``HTTP_PROXY``, with the run's credential) to the
proxy's own request desk (``http://requests.covey.invalid/``, egress/proxy/desk.py): the one
host a sandbox reaches under hard isolation. A person decides in covey; ``--wait`` waits up to
that many seconds for the decision (asking every second).

It prints the answer as JSON (``id``, ``status``; once decided ``decision``, ``note`` and
``changed``) and exits 0 when approved, 1 when rejected, 3 while pending, 2 on an error.

Installed as /usr/local/bin/covey-request in covey's base image; Python's standard library
only.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

DESK = "http://requests.covey.invalid"
MAX_WAIT = 24 * 3600
EXIT = {"approved": 0, "rejected": 1, "pending": 3}


def _opener() -> urllib.request.OpenerDirector:
    proxy = os.environ.get("http_proxy") or os.environ.get("HTTP_PROXY")
    if not proxy:
        raise SystemExit("covey-request: no HTTP_PROXY here: this runs in a covey sandbox")
    # The proxy alone (never NO_PROXY: the desk is the proxy's own).
    return urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))


def _call(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - a fixed http:// URL, through the proxy
        DESK + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with _opener().open(request, timeout=30) as response:
            answer = json.loads(response.read() or b"{}")
            if not isinstance(answer, dict):
                return 0, {"detail": f"the desk answered {answer!r}"}
            return response.status, answer
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            answer = {"detail": text.decode(errors="replace").strip()}
        return error.code, answer
    except (OSError, ValueError) as exc:
        return 0, {"detail": f"the proxy did not answer: {exc}"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="covey-request", description=__doc__.split("\n")[0])
    kinds = parser.add_subparsers(dest="command", required=True)
    egress = kinds.add_parser("egress", help="a route: host or host:port")
    egress.add_argument("target")
    package = kinds.add_parser("package", help="a package in the agent's workplace")
    package.add_argument("ecosystem", help="apt, pip or npm")
    package.add_argument(
        "package", help="name, or with a version: apt name=1.2, pip name==1.2, npm name@1.2"
    )
    for asking in (egress, package):
        asking.add_argument("--reason", required=True, help="why the agent needs it")
    status = kinds.add_parser("status", help="how a request stands")
    status.add_argument("id", type=int)
    for each in (egress, package, status):
        each.add_argument("--wait", type=float, default=0, help="seconds to wait for a decision")
    args = parser.parse_args(argv)
    wait = min(max(args.wait, 0), MAX_WAIT)

    if args.command == "status":
        code, answer = _call("GET", f"/v1/requests/{args.id}")
    elif args.command == "egress":
        filing = {"kind": "egress", "target": args.target, "reason": args.reason}
        code, answer = _call("POST", "/v1/requests", filing)
    else:
        filing = {"kind": "package", "ecosystem": args.ecosystem, "package": args.package,
                  "reason": args.reason}  # fmt: skip
        code, answer = _call("POST", "/v1/requests", filing)
    deadline = time.monotonic() + wait
    while code in (200, 201) and answer.get("status") == "pending" and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        code, answer = _call("GET", f"/v1/requests/{answer['id']}")
    print(json.dumps(answer, sort_keys=True), flush=True)
    if code not in (200, 201):
        print(f"covey-request: {answer.get('detail', code)}", file=sys.stderr)
        return 2
    return EXIT.get(str(answer.get("status")), 2)


if __name__ == "__main__":
    sys.exit(main())
