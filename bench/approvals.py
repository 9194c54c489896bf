"""Benchmark asking for a route: from ``covey-request`` to the route working through the live
proxy, not counting the person's wait (the approval is made through the API at once).

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/approvals.py            # about 40 s: 5 requests, 5 baseline changes
    .venv/bin/python bench/approvals.py --quick    # about 30 s: 3 of each

Everything runs on this machine, as in ``bench/egress.py`` (whose parts it uses): a DNS server
and a TLS upstream on loopback, a SQLite database with one agent and its egress credential, the
covey proxy (``manage.py egress_proxy``, policy and requests from the database, as on the
control-plane host) and a control plane (gunicorn). For each of N names the agent may not
reach (each is first refused: a CONNECT answered 403), it times:

1. ``covey-request egress NAME:PORT --reason …`` (the real client, egress/sandbox/covey_request.py,
   in this process, with ``HTTP_PROXY`` naming the proxy and the credential): from the call
   until it has the request's id, filed through the proxy's desk;
2. then ``POST /api/v1/requests/{id}/approve/`` as a superuser (the person's decision, made at
   once; its own time is counted), until a CONNECT to the name through the same proxy is
   answered 200, polled every 10 ms.

The figure is 1 + 2: what the agent and covey take, with the person's wait left out. It prints
the p50 and the slowest, the two parts apiece, the baseline of the same run (an allowlist change
through the API until enforced, as ``bench/egress.py`` measures it), and the target: p50 under
1.5 s. Every process it starts is stopped by its id, and its folder is removed.
"""

import argparse
import contextlib
import http.client
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

from bench.egress import (  # noqa: E402 - after the path is set
    DNS_IP,
    ECHO_NAME,
    NEW_NAMES,
    POLL_INTERVAL,
    Route,
    TunnelError,
    connect_status,
    django_env,
    make_ca,
    patch_allowlist,
    prepare_database,
    serve_dns,
    serve_upstream,
    start_child,
    start_control_plane,
    start_covey,
)
from bench.support import (  # noqa: E402
    BenchError,
    Processes,
    percentile,
    ratio,
    run_bench,
    step,
    verdict,
)

TARGET_SECONDS = 1.5
TIMEOUT = 10.0


def approve(port: int, token: str, request_id: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "POST",
            f"/api/v1/requests/{request_id}/approve/",
            body=json.dumps({"note": "bench", "scope": "agent"}),
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise BenchError(f"approve {request_id}: {response.status} {body[:300]!r}")


def ask(route: Route, host: str, port: int) -> int:
    """covey-request egress host:port, as a sandbox runs it; the request's id."""
    from egress.sandbox import covey_request

    assert route.proxy is not None  # noqa: S101 - the covey route has one
    os.environ["HTTP_PROXY"] = f"http://{route.credentials}@{route.proxy[0]}:{route.proxy[1]}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = covey_request.main(["egress", f"{host}:{port}", "--reason", "the bench needs it"])
    answer = json.loads(out.getvalue())
    if code != 3 or answer.get("status") != "pending":
        raise BenchError(f"covey-request for {host}: exit {code}, {answer}")
    return int(answer["id"])


def until_allowed(route: Route, host: str, port: int, started: float) -> float:
    while True:
        attempt = time.perf_counter()
        with contextlib.suppress(OSError, TunnelError):
            if connect_status(route, host, port) == 200:
                return time.perf_counter() - started
        if attempt - started > TIMEOUT:
            raise BenchError(f"{host} still refused {TIMEOUT:g} s after its approval")
        time.sleep(max(0.0, attempt + POLL_INTERVAL - time.perf_counter()))


def run(count: int, work: Path, processes: Processes, stack: contextlib.ExitStack) -> dict:
    _, cert_file = make_ca(work)
    dns, dns_port = start_child("bench-dns", serve_dns, 600.0)
    stack.callback(dns.stop)
    upstream, (echo_port, _) = start_child(
        "bench-upstream", serve_upstream, str(cert_file), 1024, 600.0
    )
    stack.callback(upstream.stop)
    var_dir = work / "var"
    setup = prepare_database(var_dir, [f"{ECHO_NAME}:{echo_port}"])
    env = django_env(var_dir)
    proxy_process, proxy_port = start_covey(processes, env, f"{DNS_IP}@{dns_port}")
    api_port = start_control_plane(processes, env)
    route = Route("covey", ("127.0.0.1", proxy_port), setup.credentials, proxy_process.pid)
    step(f"proxy on 127.0.0.1:{proxy_port}, control plane on 127.0.0.1:{api_port}")
    filed, decided, whole, baseline = [], [], [], []
    allowlist = [f"{ECHO_NAME}:{echo_port}"]
    for i in range(count * 2):  # alternately: a request, and (the baseline) a plain change
        host = NEW_NAMES[i]
        if connect_status(route, host, echo_port) != 403:
            raise BenchError(f"{host} was not refused first")
        started = time.perf_counter()
        if i % 2:
            allowlist.append(f"{host}:{echo_port}")
            patch_allowlist(api_port, setup.api_token, setup.agent_id, allowlist)
            baseline.append(until_allowed(route, host, echo_port, started))
            continue
        request_id = ask(route, host, echo_port)
        asked = time.perf_counter() - started
        approved = time.perf_counter()  # the person's wait would be here: none
        approve(api_port, setup.api_token, request_id)
        after = until_allowed(route, host, echo_port, approved)
        allowlist.append(f"{host}:{echo_port}")  # the approval added it
        filed.append(asked)
        decided.append(after)
        whole.append(asked + after)
        time.sleep(0.1 + (i * 0.071) % 0.25)  # spread over the proxy's poll cycle
    return {"filed": filed, "decided": decided, "whole": whole, "baseline": baseline}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="3 requests, not 5")
    args = parser.parse_args(argv)
    count = 3 if args.quick else 5  # the bench's DNS knows 10 new names: requests + baseline
    results: dict = {}

    def body(work: Path, processes: Processes, stack: contextlib.ExitStack) -> None:
        results.update(run(count, work, processes, stack))

    failed = run_bench("covey-bench-requests-", 300, body)
    if not results:
        return 1
    ms = {name: [v * 1000 for v in values] for name, values in results.items()}
    print()
    print(f"{'':<48}{'p50':>9}{'max':>9}")
    for name, label in (
        ("filed", "covey-request until filed (through the desk)"),
        ("decided", "approval via the API until the route works"),
        ("whole", "both: the agent's wait, without the person's"),
        ("baseline", "baseline: an allowlist PATCH until enforced"),
    ):
        values = ms[name]
        print(f"{label:<48}{percentile(values, 50):>7.0f}ms{max(values):>7.0f}ms")
    p50 = percentile(results["whole"], 50)
    print(f"ratio to the baseline's p50: {ratio(p50, percentile(results['baseline'], 50))}")
    met = p50 < TARGET_SECONDS
    print(f"target: p50 under {TARGET_SECONDS:g} s: {verdict(met)} ({p50 * 1000:.0f} ms)")
    return 1 if failed or not met else 0


if __name__ == "__main__":
    sys.exit(main())
