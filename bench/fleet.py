"""The load generator of ``bench/control_plane.py --fleet``: N simulated runner hosts, each with a
proxy's policy connection (the stream, or polls as before it) and a heartbeat every 5 s, in one
asyncio process apart from the control plane it loads. It prints one JSON report at the end.

Not run by hand: bench/control_plane.py starts it with what it needs (its arguments below)
and prints the figures. In order it:

1. connects every host's proxy (a stream, or a first poll) and times how long all took;
2. measures the control plane's CPU (the processes ``--pids`` names) while nothing changes and
   no heartbeat is sent: what N connected proxies cost when idle;
3. changes an agent's allowlist through the API ``--changes`` times, and times, for each
   simulated proxy, from just before the API call to the line (or poll answer) with the
   change: when the change is enforced there;
4. sends heartbeats (every 5 s from each host, spread) and holds everything for ``--hold``
   seconds, counting every error (a stream that dropped, a refused or failed call), and the
   control plane's CPU meanwhile;
5. with ``--ingest``: posts decision batches (500 events each) from 8 clients for that many
   seconds: the decision log's ingest rate.
"""

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import psutil

HEARTBEAT_SECONDS = 5.0


@dataclass
class Host:
    token: str
    generation: str = ""
    changed_at: float = 0.0  # when its proxy last took a change (monotonic)
    connected: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Counts:
    stream_drops: int = 0
    policy_errors: int = 0
    heartbeats: int = 0
    heartbeat_errors: int = 0
    heartbeat_latencies: list[float] = field(default_factory=list)
    polls: int = 0
    errors_seen: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        if len(self.errors_seen) < 10:
            self.errors_seen.append(what)


class CPU:
    """CPU seconds of the control plane's processes (each pid with its children: PostgreSQL's
    backends, gunicorn's workers)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.roots = {name: psutil.Process(pid) for name, pid in pids.items()}

    def seconds(self) -> dict[str, dict[int, float]]:
        """Each one's processes now: pid → CPU seconds so far."""
        out: dict[str, dict[int, float]] = {}
        for name, root in self.roots.items():
            out[name] = {}
            for process in [root, *root.children(recursive=True)]:
                try:
                    times = process.cpu_times()
                    out[name][process.pid] = times.user + times.system
                except psutil.NoSuchProcess:
                    pass
        return out

    async def over(self, seconds: float) -> dict[str, float]:
        """Each one's share of one core over the next ``seconds``: per process, what it used
        meanwhile (a process that started meanwhile counts from 0; one that ended meanwhile
        is not counted, so the figure is a floor)."""
        before, began = self.seconds(), time.monotonic()
        await asyncio.sleep(seconds)
        after, took = self.seconds(), time.monotonic() - began
        return {
            name: sum(cpu - before[name].get(pid, 0.0) for pid, cpu in after[name].items()) / took
            for name in after
        }


async def follow_stream(
    session: aiohttp.ClientSession, url: str, host: Host, counts: Counts, stop: asyncio.Event
) -> None:
    """One proxy following the stream, coming back (with its generation) when it drops."""
    while not stop.is_set():
        headers = {"Authorization": f"Runner {host.token}"}
        if host.generation:
            headers["If-None-Match"] = f'"{host.generation}"'
        try:
            async with session.get(url, params={"v": "2"}, headers=headers) as response:
                if response.status != 200:
                    counts.policy_errors += 1
                    counts.error(f"stream {response.status}")
                    await asyncio.sleep(1)
                    continue
                async for raw in response.content:
                    line = json.loads(raw)
                    ((kind, body),) = line.items()
                    if kind == "delta" and host.generation:
                        host.changed_at = time.monotonic()
                    host.generation = body["generation"]
                    host.connected.set()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if stop.is_set():
                return
            counts.error(f"stream: {exc!r}")
        if not stop.is_set():
            counts.stream_drops += 1
            await asyncio.sleep(1)


async def poll(
    session: aiohttp.ClientSession,
    base: str,
    every: float,
    host: Host,
    counts: Counts,
    stop: asyncio.Event,
) -> None:
    """One proxy polling as before the stream: a 304 while nothing changed."""
    await asyncio.sleep(random.uniform(0, every))  # noqa: S311 - spread, not secrets
    while not stop.is_set():
        began = time.monotonic()
        headers = {"Authorization": f"Runner {host.token}"}
        if host.generation:
            headers["If-None-Match"] = f'"{host.generation}"'
        try:
            async with session.get(f"{base}/api/v1/egress/policy/", headers=headers) as response:
                await response.read()
                counts.polls += 1
                if response.status == 200:
                    if host.generation:
                        host.changed_at = time.monotonic()
                    host.generation = response.headers["ETag"].strip('"')
                    host.connected.set()
                elif response.status != 304:
                    counts.policy_errors += 1
                    counts.error(f"poll {response.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            counts.policy_errors += 1
            counts.error(f"poll: {exc!r}")
        await asyncio.sleep(max(0.0, every - (time.monotonic() - began)))


async def heartbeats(
    session: aiohttp.ClientSession, base: str, host: Host, counts: Counts, stop: asyncio.Event
) -> None:
    await asyncio.sleep(random.uniform(0, HEARTBEAT_SECONDS))  # noqa: S311
    while not stop.is_set():
        began = time.monotonic()
        try:
            async with session.post(
                f"{base}/api/v1/runner/", json={}, headers={"Authorization": f"Runner {host.token}"}
            ) as response:
                await response.read()
                if response.status >= 300:
                    counts.heartbeat_errors += 1
                    counts.error(f"heartbeat {response.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            counts.heartbeat_errors += 1
            counts.error(f"heartbeat: {exc!r}")
        took = time.monotonic() - began
        counts.heartbeats += 1
        counts.heartbeat_latencies.append(took)
        await asyncio.sleep(max(0.0, HEARTBEAT_SECONDS - took))


async def change(
    session: aiohttp.ClientSession, base: str, user: str, agent: int, n: int, hosts: list[Host]
) -> list[float]:
    """One allowlist change through the API; seconds until each host's proxy had it (inf:
    not within 10 s)."""
    began = time.monotonic()
    async with session.patch(
        f"{base}/api/v1/agents/{agent}/",
        json={"allowlist": [f"change-{n}.bench.test"]},
        headers={"Authorization": f"Token {user}"},
    ) as response:
        body = await response.text()
        if response.status != 200:
            raise RuntimeError(f"the change was refused: {response.status} {body[:300]}")
    deadline = began + 10
    while time.monotonic() < deadline and any(h.changed_at < began for h in hosts):
        await asyncio.sleep(0.005)
    return [h.changed_at - began if h.changed_at >= began else float("inf") for h in hosts]


async def ingest(
    session: aiohttp.ClientSession, base: str, token: str, agent: int, seconds: float
) -> dict[str, float]:
    """Decision batches of 500 from 8 clients for ``seconds``: rows stored per second."""
    stored = 0
    errors = 0
    stop_at = time.monotonic() + seconds

    event = {
        "event": "decision", "agent_id": agent, "username": "bench.agent", "kind": "connect",
        "host": "ingest.bench.test", "port": 443, "allowed": False, "reason": "not-on-allowlist",
    }  # fmt: skip

    def batch() -> dict[str, list[dict[str, object]]]:
        now = time.time()
        return {"events": [{**event, "id": str(uuid.uuid4()), "at": now} for _ in range(500)]}

    async def client() -> None:
        nonlocal stored, errors
        while time.monotonic() < stop_at:
            async with session.post(
                f"{base}/api/v1/egress/decisions/",
                json=batch(),
                headers={"Authorization": f"Runner {token}"},
            ) as response:
                body = await response.json()
                if response.status == 201:
                    stored += body["recorded"]
                else:
                    errors += 1

    began = time.monotonic()
    await asyncio.gather(*(client() for _ in range(8)))
    took = time.monotonic() - began
    return {"rows_per_second": stored / took, "rows": stored, "errors": errors}


async def run(options: argparse.Namespace) -> dict[str, object]:
    tokens = json.loads(open(options.tokens).read())[: options.hosts]  # noqa: SIM115
    hosts = [Host(token) for token in tokens]
    counts = Counts()
    cpu = CPU(json.loads(options.pids))
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30, sock_connect=30)
    report: dict[str, object] = {"mode": options.mode, "hosts": len(hosts)}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.monotonic()
        if options.mode == "stream":
            policy = [
                asyncio.create_task(follow_stream(session, options.stream, h, counts, stop))
                for h in hosts
            ]
        else:
            policy = [
                asyncio.create_task(poll(session, options.base, options.poll, h, counts, stop))
                for h in hosts
            ]
        await asyncio.wait_for(asyncio.gather(*(h.connected.wait() for h in hosts)), timeout=120)
        report["connect_seconds"] = time.monotonic() - began
        report["idle_cpu"] = await cpu.over(options.idle)

        latencies: list[float] = []
        for n in range(options.changes):
            latencies += await change(session, options.base, options.user, options.agent, n, hosts)
            await asyncio.sleep(0.5)
        report["change_latencies"] = latencies

        held = time.monotonic()
        beats = [
            asyncio.create_task(heartbeats(session, options.base, h, counts, stop)) for h in hosts
        ]
        report["hold_cpu"] = await cpu.over(options.hold)
        report["hold_seconds"] = time.monotonic() - held
        if options.ingest:
            report["ingest"] = await ingest(
                session, options.base, tokens[0], options.agent, options.ingest
            )
        stop.set()
        for task in [*policy, *beats]:
            task.cancel()
        await asyncio.gather(*policy, *beats, return_exceptions=True)
    latencies_hb = sorted(counts.heartbeat_latencies)
    report.update(
        stream_drops=counts.stream_drops,
        policy_errors=counts.policy_errors,
        heartbeats=counts.heartbeats,
        heartbeat_errors=counts.heartbeat_errors,
        heartbeat_p50=latencies_hb[len(latencies_hb) // 2] if latencies_hb else 0.0,
        heartbeat_p99=latencies_hb[int(len(latencies_hb) * 0.99)] if latencies_hb else 0.0,
        polls=counts.polls,
        errors_seen=counts.errors_seen,
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["stream", "poll"], required=True)
    parser.add_argument("--base", required=True, help="the control plane's URL")
    parser.add_argument("--stream", default="", help="the policy stream's URL")
    parser.add_argument("--tokens", required=True, help="a JSON file: the runners' tokens")
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between polls")
    parser.add_argument("--user", required=True, help="an API token that may change the agent")
    parser.add_argument("--agent", type=int, required=True, help="the agent the changes change")
    parser.add_argument("--pids", required=True, help='JSON: {"web": pid, ...}')
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--ingest", type=float, default=0.0)
    options = parser.parse_args()
    report = asyncio.run(run(options))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
