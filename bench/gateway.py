"""Benchmark the model gateway: the time it adds to a streamed answer's first byte, settled
requests per second under 200 concurrent clients, and the overshoot of a budget they use up.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/gateway.py            # about 60 s
    .venv/bin/python bench/gateway.py --quick    # about 30 s

Everything runs on this machine: a fake Messages API over TLS (tests/budgets/fake_vendor.py,
a test CA's certificate for 127.0.0.40) in a process of its own, a SQLite database with one
organisation (its key), one agent (its budget) and a gateway token, and the gateway itself
(``manage.py model_gateway``, its ledger in that database). It measures, in the same run:

1. time to the first byte of a streamed answer, sequentially, straight from the fake vendor
   (the baseline: the same request, over a kept-alive TLS connection) and through the gateway
   (a kept-alive connection to it): the p50 of each and the p50 the gateway adds (target:
   within 3 ms);
2. settled requests per second with 200 clients at once for a few seconds, through the gateway
   and (the baseline) straight from the fake vendor;
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

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

import httpx  # noqa: E402
import trustme  # noqa: E402

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
TTFB_TARGET_MS = 3.0
CLIENTS = 200
BODY = {
    "model": MODEL,
    "max_tokens": 100,
    "stream": True,
    "messages": [{"role": "user", "content": "stream"}],
}


def serve_vendor(pipe: Connection, cert_dir: str) -> None:
    """The fake vendor in this child process until the pipe closes."""
    from tests.budgets.fake_vendor import fake_vendor

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(f"{cert_dir}/server.pem")
    with fake_vendor(VENDOR_HOST, context) as vendor:
        pipe.send(vendor.url)
        with contextlib.suppress(EOFError):
            pipe.recv()


def prepare(work: Path) -> tuple[dict[str, str], str, int]:
    """The database: organisation with its key, agent with a large budget, a token."""
    env = django_env(work)
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
    return env, token, agent.pk


async def first_byte(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    async with client.stream("POST", url, json=BODY, headers=headers) as response:
        if response.status_code != 200:
            raise BenchError(f"{url}: {response.status_code} {await response.aread()!r}")
        elapsed = None
        async for _ in response.aiter_raw():
            elapsed = elapsed or time.perf_counter() - started
    return elapsed or 0.0


async def ttfb(
    vendor: str, gateway: str, token: str, ca: ssl.SSLContext, samples: int
) -> tuple[list[float], list[float]]:
    direct: list[float] = []
    through: list[float] = []
    headers = {"x-api-key": token, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(verify=ca) as to_vendor, httpx.AsyncClient() as to_gateway:
        for n in range(samples + 10):  # the first ten warm up both
            a = await first_byte(to_vendor, f"{vendor}/v1/messages", headers)
            b = await first_byte(to_gateway, f"{gateway}/v1/messages", headers)
            if n >= 10:
                direct.append(a * 1000)
                through.append(b * 1000)
    return direct, through


async def crowd(
    url: str, headers: dict[str, str], seconds: float, ca: ssl.SSLContext
) -> tuple[int, int]:
    """CLIENTS clients sending one request after another for ``seconds`` (or until every one
    is refused; a busy budget's 429 is tried again after its retry-after): answered requests
    and refused ones."""
    done = refused = 0
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(verify=ca, limits=limits, timeout=60) as client:

        async def one() -> None:
            nonlocal done, refused
            while time.monotonic() < stop:
                response = await client.post(url, json=BODY, headers=headers)
                if response.status_code == 402:
                    refused += 1
                    return
                if response.status_code == 429:  # busy: requests under way hold the rest
                    await asyncio.sleep(float(response.headers.get("retry-after") or 1))
                    continue
                if response.status_code != 200:
                    raise BenchError(f"{url}: {response.status_code} {response.text}")
                done += 1

        await asyncio.gather(*(one() for _ in range(CLIENTS)))
    return done, refused


def run(quick: bool, work: Path, processes: Processes, stack: contextlib.ExitStack) -> dict:
    authority = trustme.CA()
    cert_dir = work / "certs"
    cert_dir.mkdir()
    authority.issue_cert(VENDOR_HOST).private_key_and_cert_chain_pem.write_to_path(
        str(cert_dir / "server.pem")
    )
    authority.cert_pem.write_to_path(str(cert_dir / "ca.pem"))
    ca = ssl.create_default_context(cafile=str(cert_dir / "ca.pem"))

    step("fake vendor")
    parent, child = multiprocessing.Pipe()
    vendor_process = multiprocessing.get_context("spawn").Process(
        target=serve_vendor, args=(child, str(cert_dir)), daemon=True
    )
    vendor_process.start()
    stack.callback(vendor_process.join, 10)
    stack.callback(parent.close)
    if not parent.poll(30):
        raise BenchError("the fake vendor did not start")
    vendor = parent.recv()

    step("database and gateway")
    env, token, agent_id = prepare(work)
    port = free_port()
    gateway_env = env | {
        "COVEY_MODEL_UPSTREAM": vendor,
        "COVEY_MODEL_CA_BUNDLE": str(cert_dir / "ca.pem"),
    }
    args = [sys.executable, "manage.py", "model_gateway", "--listen", f"127.0.0.1:{port}"]
    process = processes.start("gateway", args, gateway_env)
    gateway = f"http://127.0.0.1:{port}"

    def up() -> bool:
        alive(process, "gateway", processes)
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{gateway}/healthz", timeout=1).status_code == 200
        return False

    wait_until(up, 30, "the gateway answering", lambda: processes.log("gateway"))

    samples = 100 if quick else 300
    step(f"time to first byte: {samples} streamed answers each way")
    direct, through = asyncio.run(ttfb(vendor, gateway, token, ca, samples))

    seconds = 5.0 if quick else 10.0
    headers = {"x-api-key": token, "anthropic-version": "2023-06-01"}
    step(f"throughput: {CLIENTS} clients for {seconds:g} s, straight and through the gateway")
    baseline, _ = asyncio.run(crowd(f"{vendor}/v1/messages", headers, seconds, ca))
    from budgets.models import Charge

    before = Charge.objects.count()
    answered, _ = asyncio.run(crowd(f"{gateway}/v1/messages", headers, seconds, ca))
    settled = Charge.objects.count() - before

    step(f"overshoot: {CLIENTS} clients against a nearly used-up budget")
    from django.db.models import Sum

    from agents.models import Agent
    from budgets import services

    agent = Agent.objects.get(pk=agent_id)
    spent = Charge.objects.aggregate(total=Sum("cost"))["total"] or Decimal(0)
    limit = spent + Decimal("0.05")  # a few dozen requests more
    services.set_budget(agent, limit)
    ok, refused = asyncio.run(crowd(f"{gateway}/v1/messages", headers, 120, ca))
    total = Charge.objects.aggregate(total=Sum("cost"))["total"] or Decimal(0)
    log = processes.log("gateway")
    if "Traceback" in log:
        at = log.index("Traceback")
        raise BenchError(f"the gateway failed:\n{log[at : at + 3000]}")
    return {
        "direct": direct,
        "through": through,
        "baseline_rps": baseline / seconds,
        "gateway_rps": settled / seconds,
        "answered": answered,
        "settled": settled,
        "overshoot": max(total - limit, Decimal(0)),
        "limit_requests": ok,
        "refused": refused,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="fewer samples, shorter crowds")
    args = parser.parse_args(argv)
    results: dict = {}

    def body(work: Path, processes: Processes, stack: contextlib.ExitStack) -> None:
        results.update(run(args.quick, work, processes, stack))

    failed = run_bench("covey-bench-gateway-", 600, body)
    if not results:
        return 1
    direct, through = results["direct"], results["through"]
    added = percentile(through, 50) - percentile(direct, 50)
    print()
    print(f"{'time to first byte of a streamed answer':<48}{'p50':>9}{'p99':>9}")
    for label, values in (
        ("  straight from the fake vendor (baseline)", direct),
        ("  through the gateway", through),
    ):
        print(f"{label:<48}{percentile(values, 50):>7.2f}ms{percentile(values, 99):>7.2f}ms")
    times = ratio(percentile(through, 50), percentile(direct, 50))
    print(f"added by the gateway at p50: {added:.2f} ms ({times} the baseline)")
    print(f"target: within {TTFB_TARGET_MS:g} ms: {verdict(added <= TTFB_TARGET_MS)}")
    print()
    print(f"{CLIENTS} concurrent clients, streamed answers:")
    print(f"  straight from the fake vendor (baseline): {results['baseline_rps']:.0f} requests/s")
    print(
        f"  through the gateway, settled in the ledger: {results['gateway_rps']:.0f} requests/s"
        f" ({ratio(results['gateway_rps'], results['baseline_rps'])} the baseline;"
        f" {results['answered']} answered, {results['settled']} settled)"
    )
    print(
        f"overshoot of a used-up budget: ${results['overshoot']} ({results['limit_requests']}"
        f" requests fitted, {results['refused']} clients refused with 402);"
        f" target 0: {verdict(results['overshoot'] == 0)}"
    )
    print(json.dumps({"added_ttfb_ms": round(added, 3)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
