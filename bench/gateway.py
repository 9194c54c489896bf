"""Benchmark the model gateway against a bare aiohttp pass-through: the time each adds to a
streamed answer's first byte, requests per second under 200 concurrent clients (the gateway's
settled in its ledger), the CPU each spends per request, and the overshoot of a budget the
clients use up; with the ledger on SQLite (as ``make run`` has it) and on PostgreSQL.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/gateway.py                      # about 2 minutes
    .venv/bin/python bench/gateway.py --quick              # about 1 minute
    .venv/bin/python bench/gateway.py --database sqlite    # one ledger only

Everything runs on this machine: a fake Messages API over TLS (tests/budgets/fake_vendor.py,
a test CA's certificate for 127.0.0.40) in a process of its own; the baseline, a bare aiohttp
pass-through (:func:`serve_pass_through`: what any proxy in Python must do, and no more) in
another; a database with one organisation (its key), one agent (its budget) and a gateway
token: SQLite, or a PostgreSQL of the bench's own (initdb in its folder, fsync off); and the
gateway itself (``manage.py model_gateway``, its ledger in that database). Each ledger is
measured in a process of its own, the pass-through beside it in the same run:

1. time to the first byte of a streamed answer, sequentially, one after another straight from
   the fake vendor, through the pass-through and through the gateway (each over a kept-alive
   connection): the p50 each adds to the vendor's (target for the gateway: within 2 ms);
2. requests per second with 200 clients at once for a few seconds, through the pass-through
   and through the gateway (answered, and settled in the ledger), with the CPU each process
   spent per request (target: the gateway at least 0.5x the pass-through's rate);
3. then 200 clients at once against a budget of a few dozen requests, until every one is
   refused: the ledger's total against the budget (the overshoot; target: 0).
"""

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import ssl
import sys
import time
from collections.abc import Sequence
from decimal import Decimal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

import aiohttp  # noqa: E402
import psutil  # noqa: E402
import trustme  # noqa: E402
from aiohttp import web  # noqa: E402

from bench.control_plane import start_postgres  # noqa: E402
from bench.egress import django_env  # noqa: E402
from bench.support import (  # noqa: E402
    BenchError,
    Processes,
    alive,
    django_here,
    free_port,
    percentile,
    ratio,
    run_bench,
    step,
    verdict,
    wait_until,
)

VENDOR_HOST = "127.0.0.40"
MODEL = "claude-sonnet-4-5-20250929"
KEY = "sk-ant-bench-organisation-key-0000"
TTFB_TARGET_MS = 2.0
RATE_TARGET = 0.5  # of the pass-through's requests/s
CLIENTS = 200
DATABASES = ("sqlite", "postgresql")
BODY = {
    "model": MODEL,
    "max_tokens": 100,
    "stream": True,
    "messages": [{"role": "user", "content": "stream"}],
}
HEADERS = {"anthropic-version": "2023-06-01", "content-type": "application/json"}


def serve_vendor(pipe: Connection, cert_dir: str) -> None:
    """The fake vendor in this child process until the pipe closes."""
    from tests.budgets.fake_vendor import fake_vendor

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(f"{cert_dir}/server.pem")
    with fake_vendor(VENDOR_HOST, context) as vendor:
        vendor.seen = _Forgetful()  # it keeps no request: a bench sends hundreds of thousands
        pipe.send(vendor.url)
        with contextlib.suppress(EOFError):
            pipe.recv()


class _Forgetful(list[Any]):
    def append(self, item: Any) -> None:
        pass


def serve_pass_through(port: int, vendor: str, ca_file: str) -> None:
    """The baseline: a bare aiohttp pass-through on ``port`` to the vendor, as little as a proxy
    in Python can do: the request's body read, sent on with its headers (the key the caller
    sent), the answer streamed back as it comes over kept-alive TLS connections."""
    session: aiohttp.ClientSession | None = None

    async def start(app: web.Application) -> None:
        nonlocal session
        connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=ca_file), limit=0)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None  # noqa: S101 - started with the app
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SKIPPED}
        async with session.post(vendor + request.path_qs, data=body, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in SKIPPED:
                    response.headers[name] = value
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def stop(app: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application()
    app.router.add_post("/v1/messages", forward)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


SKIPPED = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def prepare(env: dict[str, str], work: Path) -> tuple[str, int]:
    """The database: organisation with its key, agent with a large budget, a token."""
    django_here(env, work)
    from datetime import timedelta

    from django.core.management import call_command
    from django.db import connections

    from agents import services as agents
    from budgets import keys, services
    from organisations import services as organisations

    call_command("migrate", verbosity=0, interactive=False)
    organisation = organisations.create_organisation("Bench", base_allowlist=[])
    agent = agents.create_agent(organisation, "caller")
    keys.set_model_key(organisation, KEY)
    services.set_budget(agent, Decimal(1000))
    token = keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))
    connections.close_all()
    return token, agent.pk


async def first_byte(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    async with session.post(url, data=json.dumps(BODY), headers=headers) as response:
        if response.status != 200:
            raise BenchError(f"{url}: {response.status} {await response.read()!r}")
        elapsed = None
        async for _ in response.content.iter_any():
            elapsed = elapsed or time.perf_counter() - started
    return elapsed or 0.0


async def ttfb(
    urls: dict[str, str], token: str, ca: ssl.SSLContext, samples: int
) -> dict[str, list[float]]:
    """First bytes, one request after another, taking turns (so a slow moment of the machine
    falls on each alike): milliseconds by name."""
    headers = {**HEADERS, "x-api-key": token}
    taken: dict[str, list[float]] = {name: [] for name in urls}
    connector = aiohttp.TCPConnector(ssl=ca, limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for n in range(samples + 10):  # the first ten warm up each
            for name, url in urls.items():
                elapsed = await first_byte(session, f"{url}/v1/messages", headers)
                if n >= 10:
                    taken[name].append(elapsed * 1000)
    return taken


async def crowd(url: str, token: str, seconds: float, ca: ssl.SSLContext) -> tuple[int, int]:
    """CLIENTS clients sending one request after another for ``seconds`` (or until every one
    is refused; a busy budget's 429 is tried again after its retry-after): answered requests
    and refused ones."""
    done = refused = 0
    stop = time.monotonic() + seconds
    headers = {**HEADERS, "x-api-key": token}
    body = json.dumps(BODY)
    connector = aiohttp.TCPConnector(ssl=ca, limit=CLIENTS)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            nonlocal done, refused
            while time.monotonic() < stop:
                async with session.post(url, data=body, headers=headers) as response:
                    answer = await response.read()
                    if response.status == 402:
                        refused += 1
                        return
                    if response.status == 429:  # busy: requests under way hold the rest
                        await asyncio.sleep(float(response.headers.get("retry-after") or 1))
                        continue
                    if response.status != 200:
                        raise BenchError(f"{url}: {response.status} {answer!r}")
                    done += 1

        await asyncio.gather(*(one() for _ in range(CLIENTS)))
    return done, refused


def cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure(database: str, quick: bool, results: dict[str, Any]) -> bool:
    """One ledger's run (in a process of its own: Django is set up once a process)."""

    def body(work: Path, processes: Processes, stack: contextlib.ExitStack) -> None:
        results.update(run(database, quick, work, processes, stack))

    return run_bench(f"covey-bench-gateway-{database}-", 600, body)


def run(
    database: str, quick: bool, work: Path, processes: Processes, stack: contextlib.ExitStack
) -> dict[str, Any]:
    authority = trustme.CA()
    cert_dir = work / "certs"
    cert_dir.mkdir()
    authority.issue_cert(VENDOR_HOST).private_key_and_cert_chain_pem.write_to_path(
        str(cert_dir / "server.pem")
    )
    ca_file = str(cert_dir / "ca.pem")
    authority.cert_pem.write_to_path(ca_file)
    ca = ssl.create_default_context(cafile=ca_file)
    spawn = multiprocessing.get_context("spawn")

    step(f"[{database}] fake vendor and pass-through")
    parent, child = multiprocessing.Pipe()
    vendor_process = spawn.Process(target=serve_vendor, args=(child, str(cert_dir)), daemon=True)
    vendor_process.start()
    stack.callback(vendor_process.join, 10)
    stack.callback(parent.close)
    if not parent.poll(30):
        raise BenchError("the fake vendor did not start")
    vendor = parent.recv()
    through_port = free_port()
    pass_through = spawn.Process(
        target=serve_pass_through, args=(through_port, vendor, ca_file), daemon=True
    )
    pass_through.start()
    stack.callback(pass_through.join, 10)
    stack.callback(pass_through.terminate)

    step(f"[{database}] database and gateway")
    env = django_env(work / "var")
    if database == "postgresql":
        port = start_postgres(processes, work)
        env["DATABASE_URL"] = f"postgres://covey@127.0.0.1:{port}/postgres"
    token, agent_id = prepare(env, work / "var")
    port = free_port()
    gateway_env = env | {"COVEY_MODEL_UPSTREAM": vendor, "COVEY_MODEL_CA_BUNDLE": ca_file}
    args = [sys.executable, "manage.py", "model_gateway", "--listen", f"127.0.0.1:{port}"]
    process = processes.start("gateway", args, gateway_env)
    urls = {
        "vendor": vendor,
        "pass-through": f"http://127.0.0.1:{through_port}",
        "gateway": f"http://127.0.0.1:{port}",
    }

    def up() -> bool:
        alive(process, "gateway", processes)
        for url in urls.values():
            with contextlib.suppress(OSError, aiohttp.ClientError):
                answer = asyncio.run(first_byte_once(url, token, ca))
                if answer != 200:
                    return False
                continue
            return False
        return True

    def gateway_log() -> str:
        return processes.log("gateway")

    wait_until(up, 30, "the gateway and the pass-through answering", gateway_log)

    samples = 100 if quick else 300
    step(f"[{database}] time to first byte: {samples} streamed answers each way")
    firsts = asyncio.run(ttfb(urls, token, ca, samples))

    from django.db.models import Sum

    from agents.models import Agent
    from budgets import services
    from budgets.models import Charge, Reservation

    def settled() -> None:
        open_ones = Reservation.objects.filter(status=Reservation.Status.OPEN)
        wait_until(lambda: not open_ones.exists(), 30, "every request settled", gateway_log)

    seconds = 5.0 if quick else 10.0
    step(f"[{database}] throughput: {CLIENTS} clients for {seconds:g} s each way")
    pids = {"pass-through": pass_through.pid, "gateway": process.pid}
    rates: dict[str, float] = {}
    cpu_ms: dict[str, float] = {}
    answered = 0
    for name in ("pass-through", "gateway"):
        settled()
        before = Charge.objects.count()
        spent = cpu(pids[name] or 0)
        done, _ = asyncio.run(crowd(f"{urls[name]}/v1/messages", token, seconds, ca))
        if name == "gateway":
            answered = done
            settled()
            done = Charge.objects.count() - before
        cpu_ms[name] = 1000 * (cpu(pids[name] or 0) - spent) / max(done, 1)
        rates[name] = done / seconds

    step(f"[{database}] overshoot: {CLIENTS} clients against a nearly used-up budget")
    agent = Agent.objects.get(pk=agent_id)
    spent_before = Charge.objects.aggregate(total=Sum("cost"))["total"] or Decimal(0)
    limit = spent_before + Decimal("0.05")  # a few dozen requests more
    services.set_budget(agent, limit)
    ok, refused = asyncio.run(crowd(f"{urls['gateway']}/v1/messages", token, 120, ca))
    settled()
    total = Charge.objects.aggregate(total=Sum("cost"))["total"] or Decimal(0)
    log = processes.log("gateway")
    if "Traceback" in log:
        at = log.index("Traceback")
        raise BenchError(f"the gateway failed:\n{log[at : at + 3000]}")
    return {
        "firsts": firsts,
        "rates": rates,
        "cpu_ms": cpu_ms,
        "answered": answered / seconds,
        "overshoot": str(max(total - limit, Decimal(0))),
        "limit_requests": ok,
        "refused": refused,
    }


async def first_byte_once(url: str, token: str, ca: ssl.SSLContext) -> int:
    connector = aiohttp.TCPConnector(ssl=ca)
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        headers = {**HEADERS, "x-api-key": token}
        async with session.post(f"{url}/v1/messages", data=json.dumps(BODY), headers=headers) as r:
            await r.read()
            return r.status


def measured(database: str, quick: bool, pipe: Connection) -> None:
    """:func:`measure` in a child process: its results (or None) down the pipe."""
    results: dict[str, Any] = {}
    failed = measure(database, quick, results)
    pipe.send(None if failed or not results else results)


def report(database: str, results: dict[str, Any]) -> None:
    """Print one ledger's figures, and whether each target was met."""
    firsts = results["firsts"]
    vendor = percentile(firsts["vendor"], 50)
    added = {name: percentile(firsts[name], 50) - vendor for name in ("pass-through", "gateway")}
    print()
    print(f"ledger on {database}")
    print(f"  {'time to first byte of a streamed answer':<46}{'p50':>9}{'p99':>9}{'added':>9}")
    for name, label in (
        ("vendor", "straight from the fake vendor"),
        ("pass-through", "through a bare aiohttp pass-through"),
        ("gateway", "through the gateway"),
    ):
        values = firsts[name]
        more = f"{added[name]:>+7.2f}ms" if name in added else ""
        print(
            f"    {label:<44}{percentile(values, 50):>7.2f}ms{percentile(values, 99):>7.2f}ms{more}"
        )
    ttfb_ok = added["gateway"] <= TTFB_TARGET_MS
    print(f"  added by the gateway at p50, target within {TTFB_TARGET_MS:g} ms: {verdict(ttfb_ok)}")
    rates, cpu_ms = results["rates"], results["cpu_ms"]
    print(f"  {CLIENTS} concurrent clients, streamed answers:")
    print(
        f"    through the pass-through (baseline): {rates['pass-through']:.0f} requests/s,"
        f" {cpu_ms['pass-through']:.2f} ms of CPU each"
    )
    print(
        f"    through the gateway, settled in the ledger: {rates['gateway']:.0f} requests/s"
        f" ({results['answered']:.0f} answered), {cpu_ms['gateway']:.2f} ms of CPU each"
    )
    share = rates["gateway"] / rates["pass-through"] if rates["pass-through"] else 0.0
    rate_ok = share >= RATE_TARGET
    print(
        f"  the gateway's rate: {ratio(rates['gateway'], rates['pass-through'])} the"
        f" pass-through's, target at least {RATE_TARGET:g}x: {verdict(rate_ok)}"
    )
    overshoot = Decimal(results["overshoot"])
    print(
        f"  overshoot of a used-up budget: ${overshoot} ({results['limit_requests']} requests"
        f" fitted, {results['refused']} clients refused with 402); target 0:"
        f" {verdict(overshoot == 0)}"
    )
    print(json.dumps({"database": database, "added_ttfb_ms": round(added["gateway"], 3),
                      "rate_ratio": round(share, 3)}))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="fewer samples, shorter crowds")
    parser.add_argument(
        "--database", choices=[*DATABASES, "both"], default="both", help="the ledger's database"
    )
    args = parser.parse_args(argv)
    failed = False
    measured_by: dict[str, dict[str, Any]] = {}
    for database in DATABASES if args.database == "both" else (args.database,):
        parent, child = multiprocessing.Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=measured, args=(database, args.quick, child)
        )
        process.start()
        child.close()
        try:
            results = parent.recv()
        except EOFError:
            results = None
        process.join()
        if results is None:
            failed = True
        else:
            measured_by[database] = results
    for database, results in measured_by.items():
        report(database, results)  # a target missed is said there, not a failure of the run
    return 1 if failed or not measured_by else 0


if __name__ == "__main__":
    sys.exit(main())
