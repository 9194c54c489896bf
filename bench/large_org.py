"""Benchmark a large organisation's policy: 10,000 agents with 100 entries each, on the stream.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/large_org.py              # about 3 min
    .venv/bin/python bench/large_org.py --agents 2000 --followers 20   # smaller, quicker

Everything runs on this machine: a PostgreSQL and a Redis of the bench's own, the control plane
as production runs it (gunicorn) and the policy stream (``manage.py policy_stream``). The
organisation has ``--agents`` agents, each with ``--entries`` entries of its own (all distinct:
the most a proxy can be made to hold), the organisation's base list and two templates, and one
live egress token each. Then:

1. the stream's first load of the organisation (a first follower, cold): seconds to its whole
   snapshot, and the snapshot's size;
2. a proxy's load, in a process of its own with the proxy's own code (``ControlPlaneSource``
   following the stream, ``Policy.from_snapshot``): seconds from its request to a policy it
   decides by, and its memory (resident, before and after; the peak);
3. ``--followers`` runner hosts' proxies following the stream besides (one asyncio process,
   reading each line), and ``--changes`` changes to one agent's allowlist through the API: the
   seconds from the API call to every follower having it (the proxy process applying it with
   ``Policy.apply``), p50 / p99 / max; and a change to a template every agent has.

It prints the figures against the issue's targets (a policy loaded in under 1 s; a change at
every proxy in under 1 s). Every process it starts is stopped by its id and its temporary folder
is removed; the run is bounded in time.
"""

import argparse
import asyncio
import contextlib
import gc
import json
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

from bench.control_plane import (  # noqa: E402 - after the path is set
    bench_env,
    start_control_plane,
    start_postgres,
    start_stream,
)
from bench.support import (  # noqa: E402
    BenchError,
    Processes,
    django_here,
    percentile,
    run_bench,
    start_redis,
    step,
    verdict,
)

AGENTS, ENTRIES, FOLLOWERS, CHANGES = 10_000, 100, 100, 20
TARGET_LOAD = 1.0  # seconds: a proxy's load of its policy
TARGET_CHANGE = 1.0  # seconds: a change to one agent at every proxy
MIB = 2**20


@dataclass
class Seeded:
    user_token: str
    runner_tokens: list[str]
    changed_agent: int
    template: str


def seed(env: dict[str, str], work: Path, agents: int, entries: int, runners: int) -> Seeded:
    """The organisation, in bulk: its agents, their entries, templates and tokens."""
    django_here(env, work / "var")
    from datetime import timedelta

    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections
    from django.utils import timezone
    from rest_framework.authtoken.models import Token

    from agents import services
    from agents.models import Agent
    from egress.models import EgressToken
    from egress.policy import hash_token
    from organisations import services as organisations
    from runners.services import create_registration_token, register_runner
    from templates.models import AllowlistTemplate

    call_command("migrate", verbosity=0, interactive=False)
    user = get_user_model().objects.create_superuser("bench", "", secrets.token_urlsafe(24))
    organisation = organisations.create_organisation("Large")
    templates = list(AllowlistTemplate.objects.order_by("slug")[:2])
    first = services.create_agent(organisation, "agent 0", templates=templates)  # versioned
    rows = [
        Agent(
            organisation=organisation,
            name=f"agent {n}",
            slug=f"agent-{n}",
            allowlist=[f"host-{k}.agent-{n}.bench.test" for k in range(entries)],
        )
        for n in range(1, agents)
    ]
    made = Agent.objects.bulk_create(rows, batch_size=500)
    through = Agent.templates.through
    through.objects.bulk_create(
        [through(agent_id=a.pk, allowlisttemplate_id=t.pk) for a in made for t in templates],
        batch_size=5000,
    )
    expires = timezone.now() + timedelta(hours=6)
    EgressToken.objects.bulk_create(
        [
            EgressToken(agent_id=a.pk, sha256=hash_token(secrets.token_hex(16)), expires_at=expires)
            for a in [first, *made]
        ],
        batch_size=5000,
    )
    tokens = []
    for n in range(runners):
        _, secret = create_registration_token(organisation)
        tokens.append(register_runner(secret, f"runner-{n}", [])[1])
    seeded = Seeded(Token.objects.create(user=user).key, tokens, first.pk, templates[0].slug)
    connections.close_all()
    return seeded


# --- the proxy: a process of its own, the proxy's code --------------------------------------


def peak() -> int:
    """This process's most resident memory so far (VmHWM, which psutil does not give), bytes.
    Not ru_maxrss: Linux keeps it across exec, so this process would show its parent's."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise BenchError("/proc/self/status has no VmHWM")


def proxy(stream: str, token: str) -> None:
    """Follow the stream as a runner host's proxy does; print one JSON line when the policy is
    loaded, then one for each delta applied."""
    from egress.policy import Policy
    from egress.protocol import PolicyDelta, PolicySnapshot
    from egress.proxy.control_plane import ControlPlaneSource

    source = ControlPlaneSource(stream.split("/api/")[0], lambda: token, timeout=60)
    source.stream_url = stream
    gc.collect()
    before = psutil.Process().memory_info().rss
    began = time.perf_counter()
    lines = source.follow(None) or iter(())
    first = next(lines, None)
    if not isinstance(first, PolicySnapshot):
        raise BenchError(f"the stream began with {first!r}, not the snapshot")
    read = time.perf_counter()
    policy = Policy.from_snapshot(first)
    built = time.perf_counter()
    agents = len(first.agents)
    entries = sum(a.own.count("\n") + 1 for a in first.agents if a.own)
    del first
    gc.collect()
    report = {
        "agents": agents,
        "entries": entries,
        "read_s": read - began,
        "build_s": built - read,
        "rss_before": before,
        "rss_after": psutil.Process().memory_info().rss,
        "rss_peak": peak(),
    }
    print(json.dumps(report), flush=True)
    for line in lines:
        if isinstance(line, PolicyDelta):
            applying = time.perf_counter()
            policy = policy.apply(line)
            took = time.perf_counter() - applying
            markers = [e for a in line.agents for e in a.own.split("\n") if e.startswith("change-")]
            print(
                json.dumps(
                    {"at": time.time(), "markers": markers, "lists": sorted(line.lists),
                     "apply_s": took}
                ),
                flush=True,
            )  # fmt: skip


# --- the followers: many proxies, each reading its stream's lines ---------------------------


@dataclass
class Followers:
    stream: str
    tokens: list[str]
    arrived: dict[str, list[float]] = field(default_factory=dict)  # marker → times
    connected: int = 0
    errors: list[str] = field(default_factory=list)

    async def follow(self, session: aiohttp.ClientSession, token: str) -> None:
        headers = {"Authorization": f"Runner {token}"}
        try:
            async with session.get(self.stream, params={"v": "2"}, headers=headers) as answer:
                if answer.status != 200:
                    self.errors.append(f"{answer.status} {await answer.text()}")
                    return
                buffer, first = b"", True
                async for chunk in answer.content.iter_any():
                    if first:  # the snapshot: skipped, not kept
                        ends = chunk.find(b"\n")
                        if ends < 0:
                            continue
                        first, chunk = False, chunk[ends + 1 :]
                        self.connected += 1
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        self.take(json.loads(line))
        except Exception as exc:  # counted, and the bench fails on it
            self.errors.append(repr(exc))

    def take(self, line: dict) -> None:
        now = time.time()
        delta = line.get("delta")
        if delta is None:
            return
        markers = {
            e for a in delta["agents"] for e in a["own"].split("\n") if e.startswith("change-")
        }
        markers |= {f"list:{name}" for name in delta["lists"]}
        for marker in markers:
            self.arrived.setdefault(marker, []).append(now)

    def run(self, stop: threading.Event) -> None:
        async def main() -> None:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                tasks = [asyncio.create_task(self.follow(session, t)) for t in self.tokens]
                while not stop.is_set():
                    await asyncio.sleep(0.1)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(main())


# --- the bench --------------------------------------------------------------------------------


@dataclass
class Result:
    agents: int = 0
    entries: int = 0
    hub_load_s: float = 0.0
    snapshot_bytes: int = 0
    stream_rss: int = 0
    proxy: dict = field(default_factory=dict)
    changes: list[float] = field(default_factory=list)  # seconds, per follower and change
    proxy_changes: list[float] = field(default_factory=list)
    apply_s: list[float] = field(default_factory=list)
    template_change: list[float] = field(default_factory=list)
    template_delta_bytes: int = 0


def measure(work: Path, processes: Processes, options: argparse.Namespace, result: Result) -> None:
    step("starting PostgreSQL and Redis of the bench's own")
    redis_port, _ = start_redis(processes, work)
    env = bench_env(work, start_postgres(processes, work), redis_port)
    step(f"an organisation of {options.agents} agents with {options.entries} entries each")
    seeded = seed(env, work, options.agents, options.entries, options.followers + 2)
    stream_process, stream = start_stream(processes, env)
    base = start_control_plane(processes, {**env, "COVEY_EGRESS_STREAM_URL": stream})

    step("the stream's first load of it (a first follower, cold)")
    runner = {"Authorization": f"Runner {seeded.runner_tokens[0]}"}
    began = time.perf_counter()
    with httpx.stream(
        "GET", stream, params={"v": "2"}, headers=runner, timeout=120
    ) as answer:  # fmt: skip
        answer.raise_for_status()
        size = 0
        for chunk in answer.iter_raw():  # the snapshot is the first line
            ends = chunk.find(b"\n")
            size += len(chunk) if ends < 0 else ends + 1
            if ends >= 0:
                break
    result.hub_load_s, result.snapshot_bytes = time.perf_counter() - began, size
    result.stream_rss = psutil.Process(stream_process.pid).memory_info().rss

    step("a proxy's load, in a process of its own")
    args = [sys.executable, __file__, "--proxy", stream, "--token", seeded.runner_tokens[1]]
    child = subprocess.Popen(  # noqa: S603 - this bench, as the proxy
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=(work / "proxy.log").open("wb"), env=env
    )
    processes.started.append(child)
    line = child.stdout.readline() if child.stdout is not None else b""
    if not line:
        raise BenchError(f"the proxy failed:\n{(work / 'proxy.log').read_text()[-3000:]}")
    result.proxy = json.loads(line)
    result.agents, result.entries = result.proxy["agents"], result.proxy["entries"]
    proxy_lines: list[dict] = []
    reader = threading.Thread(
        target=lambda: proxy_lines.extend(json.loads(raw) for raw in child.stdout or ()),
        daemon=True,
    )
    reader.start()

    step(f"{options.followers} followers besides; {options.changes} changes to one agent")
    followers = Followers(stream, seeded.runner_tokens[2:])
    stop = threading.Event()
    thread = threading.Thread(target=followers.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while followers.connected < options.followers and time.monotonic() < deadline:
        if followers.errors:
            raise BenchError(f"a follower failed: {followers.errors[:3]}")
        time.sleep(0.2)
    user = {"Authorization": f"Token {seeded.user_token}"}
    with httpx.Client(base_url=base, headers=user, timeout=30) as api:
        for n in range(options.changes):
            marker = f"change-{n}.bench.test"
            began_at = time.time()
            api.patch(
                f"/api/v1/agents/{seeded.changed_agent}/", json={"allowlist": [marker]}
            ).raise_for_status()
            arrivals = wait_for(followers, proxy_lines, marker, options.followers)
            result.changes += [at - began_at for at in arrivals[0]]
            result.proxy_changes += [at - began_at for at in arrivals[1]]
        step("a change to a template every agent has")
        template = api.get(f"/api/v1/allowlist-templates/{seeded.template}/").json()
        began_at = time.time()
        api.patch(
            f"/api/v1/allowlist-templates/{seeded.template}/",
            json={"entries": [*template["entries"], "mirror.bench.test"]},
        ).raise_for_status()
        marker = f"list:template:{seeded.template}"
        arrivals = wait_for(followers, proxy_lines, marker, options.followers)
        result.template_change = [at - began_at for at in arrivals[0] + arrivals[1]]
    result.apply_s = [line["apply_s"] for line in proxy_lines]
    stop.set()
    thread.join(10)
    if followers.errors:
        raise BenchError(f"followers failed: {followers.errors[:3]}")
    for name in ("control-plane", "stream"):
        if "Traceback" in processes.log(name):
            raise BenchError(f"the {name} logged an exception:\n{processes.log(name)[-3000:]}")


def wait_for(
    followers: Followers, proxy_lines: list[dict], marker: str, count: int
) -> tuple[list[float], list[float]]:
    """When each follower, and the proxy, had the change ``marker`` names (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        at_proxy = [
            line["at"]
            for line in proxy_lines
            if marker in line["markers"] or marker.removeprefix("list:") in line["lists"]
        ]
        if len(followers.arrived.get(marker, [])) >= count and at_proxy:
            return followers.arrived[marker], at_proxy
        time.sleep(0.01)
    raise BenchError(f"{marker} did not reach every proxy within 10 s")


def report(result: Result) -> None:
    load = result.proxy["read_s"] + result.proxy["build_s"]
    held = result.proxy["rss_after"] - result.proxy["rss_before"]
    changes = [1000 * s for s in result.changes + result.proxy_changes]
    print()
    print(f"An organisation of {result.agents} agents, {result.entries} entries of their own:")
    print(
        f"- the stream's first load (cold): {result.hub_load_s:.2f} s; the snapshot"
        f" {result.snapshot_bytes / MIB:.1f} MiB; the stream process then holds"
        f" {result.stream_rss / MIB:.0f} MiB resident"
    )
    print(
        f"- a proxy's load: {load:.2f} s (read and parsed {result.proxy['read_s']:.2f} s, built"
        f" {result.proxy['build_s']:.2f} s) (< {TARGET_LOAD:g} s): {verdict(load < TARGET_LOAD)}"
    )
    print(
        f"- the proxy's memory: {held / MIB:.0f} MiB held for the policy"
        f" ({result.proxy['rss_before'] / MIB:.0f} → {result.proxy['rss_after'] / MIB:.0f} MiB"
        f" resident), peak {result.proxy['rss_peak'] / MIB:.0f} MiB while loading"
    )
    print(
        f"- a change to one agent at every proxy ({len(changes)} arrivals): p50"
        f" {percentile(changes, 50):.0f} / p99 {percentile(changes, 99):.0f} / max"
        f" {max(changes):.0f} ms (< {1000 * TARGET_CHANGE:.0f}):"
        f" {verdict(max(changes) < 1000 * TARGET_CHANGE)}; the proxy applies a delta in"
        f" {1000 * percentile(result.apply_s, 50):.1f} ms (p50)"
    )
    template = [1000 * s for s in result.template_change]
    print(
        f"- a change to a template every agent has, at every proxy: p50"
        f" {percentile(template, 50):.0f} / max {max(template):.0f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=AGENTS)
    parser.add_argument("--entries", type=int, default=ENTRIES)
    parser.add_argument("--followers", type=int, default=FOLLOWERS)
    parser.add_argument("--changes", type=int, default=CHANGES)
    parser.add_argument("--proxy", help=argparse.SUPPRESS)  # the proxy process: its stream
    parser.add_argument("--token", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.proxy:
        with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
            proxy(options.proxy, options.token)
        return 0
    result = Result()

    def body(work: Path, processes: Processes, stack: contextlib.ExitStack) -> None:
        measure(work, processes, options, result)

    failed = run_bench("covey-bench-large-org-", 1200, body)
    if result.changes:
        report(result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
