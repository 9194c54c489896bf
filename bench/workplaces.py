"""Benchmark a workplace's services: how much later a run's sandbox starts when two companion
services must be ready first, against the same sandbox without services, in the same run.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/workplaces.py            # about 1 min: 20 launches of each kind
    .venv/bin/python bench/workplaces.py --quick    # about 20 s: 6 of each

Everything runs on this machine, on the Docker engine ``docker`` talks to, with the image
``covey-base:trixie`` (``make base-image``; nothing is pulled), through the runner host's own
Docker seam (``runners/host/containers/engine.py``, as a runner launches a run: the network
holder, the services in its namespace, their readiness checks, then the sandbox). The services
are two containers of the base image running ``sleep infinity`` whose readiness check is
``true``: ready at the first check, so what is measured is covey's cost of services, not a
database's start-up. The sandbox's command is ``date +%s%N``: it prints the wall clock in ns
when its process starts (containers share the host's clock), read back from its log and
subtracted from ``time.time_ns()`` taken just before ``launch``. Launches with and without
services alternate (the first of each is a warm-up, not counted), so drift hits both alike.

It prints the p50 and p95 of both, the difference of the p50s and their ratio, and the target:
the p50 with two instantly ready services within 1 s of the p50 without. Every container and
network it made is removed (by the labels of a runner name of its own).
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from uuid import uuid4

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support import percentile, ratio, step, verdict
from runners.host.containers import companions
from runners.host.containers.engine import Engine, SandboxSpec
from runners.protocol import Readiness, ServiceSpec

IMAGE = "covey-base:trixie"
DOCKER = shutil.which("docker") or "docker"
TARGET_SECONDS = 1.0
SERVICES = tuple(
    ServiceSpec(
        name=name,
        image=IMAGE,
        command=("sleep", "infinity"),
        ready=Readiness(command=("true",), interval=0.1, timeout=30),
        memory_mb=32,
    )
    for name in ("db", "cache")
)


def launch(engine: Engine, home: Path, services: Sequence[ServiceSpec]) -> float:
    """Seconds from the call to the sandbox's process starting."""
    spec = SandboxSpec(
        run_id=f"bench-{uuid4().hex[:12]}",
        agent_id=1,
        image=IMAGE,
        command=["date", "+%s%N"],
        task="bench",
        environment={},
        home=home,
        memory_mb=64,
        services=tuple(services),
    )
    before = time.time_ns()
    try:
        engine.launch(spec)
        engine.wait(spec.run_id, 30)
        started = int(engine.logs(spec.run_id).strip())
    finally:
        engine.remove(spec.run_id)
    return (started - before) / 1e9


def leftovers(runner: str) -> list[str]:
    found = []
    for label in (f"covey.runner={runner}", f"{companions.LABEL_PART_RUNNER}={runner}"):
        found += subprocess.run(  # noqa: S603 - docker with our own arguments
            [DOCKER, "ps", "--all", "--quiet", "--filter", f"label={label}"],
            capture_output=True, text=True, check=False,
        ).stdout.split()  # fmt: skip
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="6 launches of each kind, not 20")
    args = parser.parse_args(argv)
    count = 6 if args.quick else 20
    runner = f"bench-{uuid4().hex[:8]}"
    engine = Engine(runner)
    without: list[float] = []
    with_services: list[float] = []
    with tempfile.TemporaryDirectory(prefix="covey-bench-workplaces-") as work:
        home = Path(work) / "home"
        try:
            step(f"{count} launches with two services and {count} without, alternating")
            for n in range(count + 1):
                plain = launch(engine, home, ())
                served = launch(engine, home, SERVICES)
                if n:  # the first of each warms the engine up
                    without.append(plain)
                    with_services.append(served)
        finally:
            left = leftovers(runner)
            if left:
                remove = [DOCKER, "rm", "--force", *left]
                subprocess.run(remove, capture_output=True, check=False)  # noqa: S603
    p50_without, p50_with = percentile(without, 50), percentile(with_services, 50)
    print()
    print(f"{'sandbox start after launch':<36}{'p50':>10}{'p95':>10}")
    print(f"{'  without services':<36}{p50_without:>9.3f}s{percentile(without, 95):>9.3f}s")
    print(f"{'  with two services, ready at once':<36}{p50_with:>9.3f}s"
          f"{percentile(with_services, 95):>9.3f}s")  # fmt: skip
    difference = p50_with - p50_without
    print(f"difference of the p50s: {difference:+.3f} s; ratio {ratio(p50_with, p50_without)}")
    met = difference <= TARGET_SECONDS
    print(f"target: within {TARGET_SECONDS:g} s of a run without services: {verdict(met)}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
