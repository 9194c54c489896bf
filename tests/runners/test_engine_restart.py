"""The Docker engine restarts under a running runner (hard isolation): the runner notices at
once (the engine's event stream ends), takes no work while it is gone, and once it is back
rebuilds its isolation shape and passes a new egress probe before it takes any; the run the
engine took with it ends saying so.

The runner host is a container with its own engine (tests/runners/contained.py): restarting
this machine's engine would stop every container on it, the test's or not, and a second engine
beside it deletes that engine's default bridge when it restarts."""

import json
import subprocess
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
from django.conf import settings

from runners.host.containers import isolation
from runners.host.identity import docker_name
from runners.models import Probe, Runner
from runners.services import installation_key
from runs import services as run_services
from runs.models import FINISHED, RunStatus
from tests.processes import wait_for
from tests.runners.contained import ContainedHost, runner_host_image
from tests.runners.isolation_support import unavailable
from tests.runners.world import UPSTREAM_NAME, Relay, World, runner_ids_apart, serve

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]

CONTROL_PLANE_IMAGE = "covey:latest"  # make control-plane-image


@pytest.fixture
def world(tmp_path, base_image, egress_image) -> Iterator[World]:
    runner_ids_apart()
    built = World(tmp_path, base_image, egress_image)
    yield built
    built.close()


@pytest.fixture
def contained(world, tmp_path, base_image, egress_image) -> Iterator[ContainedHost]:
    if subprocess.run(["docker", "image", "inspect", CONTROL_PLANE_IMAGE],
                      capture_output=True).returncode != 0:  # fmt: skip
        unavailable(f"no image {CONTROL_PLANE_IMAGE}: run `make control-plane-image`")
    host = ContainedHost(
        runner_host_image(base_image, CONTROL_PLANE_IMAGE), world.host, tmp_path / "contained"
    )
    try:
        host.start_engine()
        host.load(egress_image, base_image)
        yield host
    finally:
        host.close()


@pytest.mark.suite("faults")
def test_after_its_docker_engine_restarts_a_runner_rebuilds_and_probes_before_work(
    world, contained, acme, cases
):
    broker = urlparse(settings.CELERY_BROKER_URL)
    relay = Relay((world.host, 0), broker.port or 6379)  # the broker listens on loopback
    serve(world.resources, relay)
    runner, config = world.register(acme, "contained")
    name = docker_name(runner.pk, installation_key())
    identity = json.loads(config.read_text()) | {
        "url": f"http://host.docker.internal:{world.relay_port}"
    }
    contained.start_runner(
        identity,
        world.runner_env()
        | {
            "CELERY_BROKER_URL": f"redis://host.docker.internal:{relay.server_address[1]}"
            f"{broker.path}",
            "COVEY_VAR_DIR": "/work/var",
            "COVEY_RUNNER_HOMES": "/work/homes",
            "COVEY_RUNNER_HEARTBEAT_SECONDS": "0.5",
            # A probe that fails (the remade networks may not carry traffic at once on a busy
            # machine) is tried again soon; no work is taken until one passes.
            "COVEY_RUNNER_PROBE_RETRY_SECONDS": "5",
        },
    )
    output = contained.runner_output
    assert "egress probe passed" in output(), output()
    fetch = ["sh", "-c", f"curl -sS --max-time 10 http://{UPSTREAM_NAME}/"]
    waiter = world.stack.agent(acme, "Waiter", ["sh", "-c", "echo started; sleep 600"])
    fetcher = world.stack.agent(acme, "Fetcher", fetch, allowlist=[f"{UPSTREAM_NAME}:80"])
    long = run_services.queue_run(waiter, "wait")
    world.stack.wait(long, RunStatus.RUNNING, timeout=120)
    first_proxy = contained.docker("inspect", isolation.proxy_container_name(name))

    gone_for = contained.stop_engine()

    def not_ready() -> bool:
        runner.refresh_from_db()
        return not runner.host_ready and "the Docker engine went away" in runner.host_problem

    wait_for(not_ready, 30, "the runner saying its engine went away")
    after = run_services.queue_run(fetcher, "after the restart")
    after.refresh_from_db()
    assert after.status == RunStatus.QUEUED, (after.status, after.status_detail)
    contained.start_engine()

    long = world.stack.wait(long, *FINISHED, timeout=120)
    assert long.status == RunStatus.FAILED
    assert "the Docker engine on contained stopped during the run" in long.status_detail
    after = world.stack.wait(after, *FINISHED, timeout=180)
    assert after.status == RunStatus.SUCCEEDED, (after.status_detail, after.log_tail, output())
    assert world.body in after.log_tail
    restarted = Probe.objects.filter(runner=runner, reason="the Docker engine restarted").get()
    # The restart's probe passed, or (on a busy machine) a retry of it soon after did.
    probe = (
        Probe.objects.filter(runner=runner, status="passed", created_at__gte=restarted.created_at)
        .order_by("created_at")
        .first()
    )
    assert probe is not None and probe.finished_at is not None
    assert after.started_at > probe.finished_at  # no work before the new probe passed
    runner = Runner.objects.get(pk=runner.pk)
    assert runner.host_ready and runner.last_probe == probe
    said = output()
    assert "the Docker engine went away" in said and "the Docker engine is back" in said
    # Its shape stands again: the proxy is running (started anew), on both its networks.
    proxy = json.loads(contained.docker("inspect", isolation.proxy_container_name(name)))[0]
    assert proxy["State"]["Running"]
    assert proxy["State"]["StartedAt"] != json.loads(first_proxy)[0]["State"]["StartedAt"]
    assert set(proxy["NetworkSettings"]["Networks"]) == {
        isolation.internal_network_name(name),
        isolation.outward_network_name(name),
    }
    back_after = (after.started_at - restarted.created_at).total_seconds()
    cases.add(3)
    cases.note(
        f"Docker engine stopped ({gone_for:.1f} s to stop) under a runner with a run: the run"
        f" failed saying so; a new probe passed before the next launch ({back_after:.1f} s from"
        " the probe's start to that run's)"
    )
