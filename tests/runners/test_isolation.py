"""Hard isolation (runners/host/containers/isolation.py) against the real engine, the real
proxy image (covey-egress:latest, `make egress-image`) and the host firewall (root and
iptables).

The proxy is told of a control plane that does not exist (its own loopback): after a one-second
grace it refuses everything, which is all the network shape needs. Every probe runs from a
sandbox container towards listeners this file starts (on the host, in containers); nothing is
sent to a public address. Containers are inspected with the docker CLI (only the seams import
docker). Everything this file creates carries a label, a name or a rule comment unique to the
session, and is removed by it; the last test and the module's cleanup check nothing is left.
"""

import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from uuid import uuid4

import pytest

from runners.host.containers import companions, isolation
from runners.host.containers.engine import Engine, SandboxSpec
from runners.host.containers.isolation import (
    IsolationError,
    Shape,
    check_rules,
    check_sandbox_networks,
    ensure_rules,
    ensure_shape,
    preflight,
    proxy_address,
    remove_rules,
    sandbox_network_options,
    teardown,
)
from runners.protocol import Readiness, ServiceSpec
from tests.processes import wait_for
from tests.runners.isolation_support import (
    NOWHERE,
    PROXY_ENV,
    RUNNER,
    SESSION,
    TEST_LABEL,
    WAIT,
    docker,
    firewall_lines,
    image_id,
    inspect,
    leftovers,
)


def clean(runner: str) -> None:
    """Remove the runner's shape whatever state it is in, and this session's containers."""
    labelled = docker("ps", "--all", "--quiet", "--filter", f"label={TEST_LABEL}").stdout.split()
    labelled += docker(
        "ps", "--all", "--quiet", "--filter", f"label=covey.runner={runner}"
    ).stdout.split()
    if labelled:
        docker("rm", "--force", *labelled, check=False)
    with contextlib.suppress(IsolationError):
        teardown(runner)
    remove_rules(runner)
    for label in (f"covey.isolation={runner}", TEST_LABEL):
        networks = docker("network", "ls", "--quiet", "--filter", f"label={label}").stdout.split()
        if networks:
            docker("network", "rm", *networks, check=False)


@dataclass
class State:
    """The module's shape; tests that rebuild it keep the new one here."""

    shape: Shape


@pytest.fixture(scope="module")
def state(egress_image: str) -> Iterator[State]:
    clean(RUNNER)
    try:
        shape = ensure_shape(
            RUNNER, egress_image, NOWHERE, "x", environment=PROXY_ENV, ready_timeout=WAIT
        )
        yield State(shape)
    finally:
        clean(RUNNER)
    assert leftovers(RUNNER) == [], "the shape was left behind"


@pytest.fixture
def shape(state: State) -> Shape:
    return state.shape


@pytest.fixture(scope="module")
def engine(state: State) -> Iterator[Engine]:
    """The runner's engine, which builds the sandboxes here as it does for real runs."""
    engine = Engine(RUNNER)
    yield engine
    for sandbox in engine.sandboxes():
        engine.remove(sandbox.run_id)


def sandbox_spec(shape: Shape, home: Path, command: list[str], **changes) -> SandboxSpec:
    spec = SandboxSpec(
        run_id=f"iso-{uuid4().hex[:12]}",
        agent_id=1,
        image="covey-base:trixie",
        command=command,
        task="probe",
        environment={},
        home=home,
        **sandbox_network_options(shape),
    )
    return replace(spec, **changes)


def cli_options(shape: Shape) -> list[str]:
    """sandbox_network_options as docker CLI flags."""
    options = sandbox_network_options(shape)
    return [
        f"--network={options['network']}",
        *(f"--dns={server}" for server in options["dns"]),
        *(f"--dns-option={option}" for option in options["dns_opt"]),
        *(f"--sysctl={key}={value}" for key, value in options["sysctls"].items()),
    ]


def wait_for_log(container: str, text: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = docker("logs", container, check=False)
        if text in result.stdout + result.stderr:
            return
        time.sleep(0.1)
    raise AssertionError(f"{container} never printed {text!r}: {result.stdout}{result.stderr}")


LISTENER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen(16)
print("ready", flush=True)
while True:
    s.accept()[0].close()
"""

# Runs in sandbox A; prints one JSON object. Every probe has a short timeout; they run at once.
PROBE = r"""
import json, os, socket, struct, threading, time
spec = json.loads(os.environ["PROBE"])
out = {}

def tcp(name, host, port):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        if name == "proxy":
            s.sendall(b"CONNECT nonexistent.example:443 HTTP/1.1\r\n\r\n")
            out["proxy_answer"] = s.recv(64).decode(errors="replace").split("\r\n")[0]
        out[name] = "open"
    except OSError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
    finally:
        s.close()

def query(name, server):
    header = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    q = header + b"\x0bnonexistent\x07example\x00\x00\x01\x00\x01"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(q, (server, 53))
        r = s.recv(512)
        out[name] = {"rcode": r[3] & 15, "answers": struct.unpack(">H", r[6:8])[0]}
    except OSError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"

def lookup(name, host):
    started = time.monotonic()
    try:
        out[name] = sorted({a[4][0] for a in socket.getaddrinfo(host, 443)})
    except OSError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
    out[name + "_seconds"] = round(time.monotonic() - started, 2)

jobs = [threading.Thread(target=tcp, args=(n, h, p)) for n, (h, p) in spec["tcp"].items()]
jobs += [threading.Thread(target=query, args=(n, h)) for n, h in spec["dns"].items()]
jobs += [threading.Thread(target=lookup, args=(n, h)) for n, h in spec["names"].items()]
for job in jobs:
    job.start()
for job in jobs:
    job.join()
conf = "/proc/sys/net/ipv6/conf"
out["ipv6_disabled"] = {
    i: open(f"{conf}/{i}/disable_ipv6").read().strip() for i in ("all", "default", "eth0")
}
out["ipv6_addresses"] = open("/proc/net/if_inet6").read()
try:
    s6 = socket.socket(socket.AF_INET6)
    s6.settimeout(1)
    s6.connect(("::1", 9))
    out["ipv6_connect"] = "open"
except OSError as exc:
    out["ipv6_connect"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


class DnsTrap:
    """A UDP listener on the host's port 53 of one address: records every datagram."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.2)
        self.seen: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, sender = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            self.seen.append(sender)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


# --- pure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "-lead", "a/b", "a b", "x" * 64, "é"])
def test_it_refuses_runner_names_that_cannot_name_networks_and_rules(name):
    with pytest.raises(ValueError, match="runner name"):
        isolation.check_runner(name)


def test_bridge_names_fit_the_kernels_interface_limit():
    assert len(isolation.bridge_name("x" * 63)) <= 15
    assert isolation.bridge_name("a") != isolation.bridge_name("b")


def test_a_sandbox_on_the_host_network_or_a_second_network_is_refused():
    shape = Shape(
        runner="r", image_id="sha256:1", internal_network="covey-internal-r",
        internal_network_id="n1", outward_network="covey-outward-r", outward_network_id="n2",
        bridge="coveyx", subnet="10.213.1.0/24", gateway="10.213.1.1", proxy_ip="10.213.1.2",
        proxy_container="covey-egress-r",
    )  # fmt: skip
    options = sandbox_network_options(shape)
    good = {
        "HostConfig": {
            "NetworkMode": options["network"],
            "Dns": options["dns"],
            "Sysctls": options["sysctls"],
        },
        "NetworkSettings": {"Networks": {"covey-internal-r": {"NetworkID": "n1"}}},
    }
    assert check_sandbox_networks(good, shape) == []
    on_host = {"HostConfig": {**good["HostConfig"], "NetworkMode": "host"},
               "NetworkSettings": {"Networks": {"host": {}}}}  # fmt: skip
    assert any("network mode is host" in p for p in check_sandbox_networks(on_host, shape))
    no_dns = {**good, "HostConfig": {**good["HostConfig"], "Dns": []}}
    assert any("DNS" in p for p in check_sandbox_networks(no_dns, shape))
    admin = {**good, "HostConfig": {**good["HostConfig"], "CapAdd": ["NET_ADMIN"]}}
    assert check_sandbox_networks(admin, shape) == ["it adds NET_ADMIN"]


# --- the shape ------------------------------------------------------------------------------


@pytest.mark.docker
def test_ensure_shape_builds_both_networks_the_proxy_and_the_rules(shape, egress_image):
    assert shape.image_id == image_id(egress_image)
    assert proxy_address(shape) == f"{shape.proxy_ip}:3128"

    internal = inspect(shape.internal_network)
    assert (internal["Id"], internal["Driver"]) == (shape.internal_network_id, "bridge")
    assert internal["Internal"] is True
    assert internal["EnableIPv6"] is False
    assert internal["Options"] == {
        "com.docker.network.bridge.enable_icc": "false",
        "com.docker.network.bridge.name": shape.bridge,
    }
    assert internal["Labels"]["covey.runner"] == RUNNER
    [config] = internal["IPAM"]["Config"]
    assert config["Subnet"] == shape.subnet and shape.subnet.endswith(".0/24")
    assert config["Gateway"] == shape.gateway
    outward = inspect(shape.outward_network)
    assert (outward["Internal"], outward["EnableIPv6"]) == (False, False)

    proxy = inspect(shape.proxy_container)
    assert proxy["Id"] == shape.proxy_container_id
    assert proxy["Image"] == shape.image_id  # the ID, not the tag
    assert proxy["State"]["Status"] == "running"
    host = proxy["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert host["Init"] is True
    assert "/tmp" in host["Tmpfs"]  # noqa: S108
    assert host["CapDrop"] == ["ALL"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["RestartPolicy"]["Name"] == "unless-stopped"
    networks = proxy["NetworkSettings"]["Networks"]
    assert set(networks) == {shape.internal_network, shape.outward_network}
    assert networks[shape.internal_network]["IPAddress"] == shape.proxy_ip
    env = set(proxy["Config"]["Env"])
    assert {f"COVEY_CONTROL_PLANE_URL={NOWHERE}", "COVEY_RUNNER_TOKEN=x"} <= env
    assert "covey.runner" not in proxy["Config"]["Labels"]  # the engine's sandboxes carry it

    assert check_rules(shape) == []
    assert preflight(shape, shape.image_id, RUNNER) == []
    assert isolation.check_shape(RUNNER, shape.image_id) == []
    # Its status answers this host on the outward side: alive, and not ready while its policy
    # source (nowhere) has never answered.
    status = isolation.proxy_outward_address(shape)
    healthz = urllib.request.urlopen(f"http://{status}:{isolation.PROXY_STATUS_PORT}/healthz")
    assert healthz.status == 200
    said = isolation.proxy_readiness(shape)
    assert said.startswith("the proxy is not ready (policy: "), said
    lines = firewall_lines(RUNNER)
    assert any(" INPUT " in line and f"-i {shape.bridge}" in line for line in lines), lines
    assert Engine(RUNNER).sandboxes() == []  # the proxy is not taken for a sandbox


@pytest.mark.docker
def test_a_second_call_changes_nothing(shape, egress_image):
    before = (firewall_lines(RUNNER), inspect(shape.proxy_container)["State"]["StartedAt"])

    again = ensure_shape(RUNNER, egress_image, NOWHERE, "x", environment=PROXY_ENV)

    assert again == shape
    assert (firewall_lines(RUNNER), inspect(shape.proxy_container)["State"]["StartedAt"]) == before


@pytest.mark.docker
def test_a_sandbox_reaches_the_proxy_and_nothing_else(shape, engine, tmp_path):
    # A listener on the host, on every address: the connect to the host must fail anyway.
    host_listener = socket.socket()
    host_listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    host_listener.bind(("0.0.0.0", 0))
    host_listener.listen(16)
    host_port = host_listener.getsockname()[1]
    socket.create_connection((shape.gateway, host_port), timeout=2).close()  # it listens
    trap = DnsTrap(shape.gateway)
    outward_listener = f"covey-isotest-{SESSION}-outward"
    launched: list[str] = []
    try:
        # Sandbox B listens on the internal network; a container listens on the outward one.
        b = sandbox_spec(shape, tmp_path / "b", ["python3", "-c", LISTENER])
        launched.append(b.run_id)
        engine.launch(b)
        b_container = f"covey-run-{b.run_id}"
        wait_for_log(b_container, "ready")
        b_ip = inspect(b_container)["NetworkSettings"]["Networks"][shape.internal_network]
        docker(
            "run", "--detach", "--name", outward_listener, "--label", TEST_LABEL,
            "--network", shape.outward_network, "--cap-drop", "ALL",
            "covey-base:trixie", "python3", "-c", LISTENER,
        )  # fmt: skip
        wait_for_log(outward_listener, "ready")
        outward_ip = inspect(outward_listener)["NetworkSettings"]["Networks"][
            shape.outward_network
        ]["IPAddress"]
        socket.create_connection((outward_ip, 8080), timeout=2).close()  # it listens
        proxy = inspect(shape.proxy_container)["NetworkSettings"]["Networks"]
        default_bridge = Engine("address").bridge_address()
        outward_gateway = proxy[shape.outward_network]["Gateway"]

        probe = {
            "tcp": {
                "proxy": [shape.proxy_ip, 3128],
                "host_gateway": [shape.gateway, host_port],
                "host_outward_gateway": [outward_gateway, host_port],
                "host_docker0": [default_bridge, host_port],
                "sandbox_b": [b_ip["IPAddress"], 8080],
                "outward_listener": [outward_ip, 8080],
                "proxy_outward_side": [proxy[shape.outward_network]["IPAddress"], 3128],
                "proxy_status": [shape.proxy_ip, isolation.PROXY_STATUS_PORT],
            },
            "dns": {"embedded_resolver": "127.0.0.11", "host_resolver": shape.gateway},
            "names": {"outside_name": "nonexistent.example", "proxy_name": shape.proxy_container},
        }
        a = sandbox_spec(
            shape,
            tmp_path / "a",
            ["python3", "-c", PROBE],
            environment={"PROBE": json.dumps(probe)},
        )
        launched.append(a.run_id)
        engine.launch(a)
        assert check_sandbox_networks(inspect(f"covey-run-{a.run_id}"), shape) == []
        done = engine.wait(a.run_id, timeout=WAIT)
        output = engine.logs(a.run_id)
        assert done.exit_code == 0, output
        seen = json.loads(output)
    finally:
        trap.close()
        host_listener.close()
        docker("rm", "--force", outward_listener, check=False)
        for run_id in launched:
            engine.remove(run_id)

    # The one way out.
    assert seen["proxy"] == "open", seen
    assert seen["proxy_answer"].startswith("HTTP/1.1 "), seen
    # Nothing else: the host (three of its addresses), sandbox B, the outward side.
    closed = [
        "host_gateway", "host_outward_gateway", "host_docker0", "sandbox_b",
        "outward_listener", "proxy_outward_side", "proxy_status",
    ]  # fmt: skip
    assert {name: seen[name] for name in closed if seen[name] == "open"} == {}, seen
    # No DNS for outside names: the embedded resolver does not answer them, the host's port 53
    # gets nothing, and a lookup fails fast (dns_opt); names on the network still resolve.
    embedded = seen["embedded_resolver"]
    assert isinstance(embedded, str) or embedded["answers"] == 0, seen
    assert isinstance(seen["host_resolver"], str), seen
    assert trap.seen == []
    assert isinstance(seen["outside_name"], str), seen
    assert seen["outside_name_seconds"] < 5, seen
    assert seen["proxy_name"] == [shape.proxy_ip], seen
    # No IPv6 at all.
    assert seen["ipv6_disabled"] == {"all": "1", "default": "1", "eth0": "1"}, seen
    assert seen["ipv6_addresses"] == "", seen
    assert seen["ipv6_connect"] != "open", seen


@pytest.mark.docker
def test_a_sandbox_on_another_network_as_well_is_refused(shape):
    name = f"covey-isotest-{SESSION}-two-networks"
    try:
        docker(
            "create", "--name", name, "--label", TEST_LABEL, *cli_options(shape),
            "covey-base:trixie", "true",
        )  # fmt: skip
        assert check_sandbox_networks(inspect(name), shape) == []
        docker("network", "connect", shape.outward_network, name)
        assert check_sandbox_networks(inspect(name), shape) == [
            f"it is also on {shape.outward_network}"
        ]
    finally:
        docker("rm", "--force", name, check=False)
    default = f"covey-isotest-{SESSION}-default"
    try:
        docker("create", "--name", default, "--label", TEST_LABEL, "covey-base:trixie", "true")
        problems = check_sandbox_networks(inspect(default), shape)
        assert any("network mode is" in p for p in problems), problems
    finally:
        docker("rm", "--force", default, check=False)


@pytest.mark.docker
def test_services_share_the_isolated_namespace_and_no_other_sandbox_reaches_them(
    shape, engine, tmp_path
):
    """Issue 12: a run's services sit in its network holder's namespace, on the internal
    network like any sandbox: reached by name from their sandbox, by no other sandbox, and
    with no way out but the proxy themselves."""
    ready = "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/')"
    web = ServiceSpec(
        name="web",
        image="covey-base:trixie",
        command=("python3", "-m", "http.server", "8080"),
        ready=Readiness(command=("python3", "-c", ready), interval=0.2, timeout=30),
        memory_mb=64,
    )
    fetch = ["curl", "--silent", "--max-time", "3", "-o", "/dev/null", "-w", "%{http_code}"]
    command = ["sh", "-c", f"{' '.join(fetch)} http://web:8080/; echo; sleep 30"]
    a = sandbox_spec(shape, tmp_path / "a", command, services=(web,))
    launched = [a.run_id]
    try:
        engine.launch(a)
        holder = inspect(companions.holder_name(a.run_id))
        assert check_sandbox_networks(holder, shape) == []
        sandbox = inspect(f"covey-run-{a.run_id}")
        assert sandbox["HostConfig"]["NetworkMode"] == f"container:{holder['Id']}"
        address = holder["NetworkSettings"]["Networks"][shape.internal_network]["IPAddress"]
        # (a line: Docker keeps a partial one back until the container ends)
        wait_for(lambda: engine.logs(a.run_id) == "200\n", WAIT, "the sandbox fetching from web")
        b = sandbox_spec(shape, tmp_path / "b", [*fetch, f"http://{address}:8080/"])
        launched.append(b.run_id)
        engine.launch(b)
        engine.wait(b.run_id, timeout=WAIT)
        assert engine.logs(b.run_id) == "000"  # ICC off and the firewall: not from another
        # The service itself: the host is closed to it, the proxy is its only way out.
        service = companions.service_name(a.run_id, "web")
        probe = (
            "import socket,sys\n"
            "for host, port in (sys.argv[1], 9), (sys.argv[2], 3128):\n"
            "    try: socket.create_connection((host, port), 2).close(); print('open')\n"
            "    except OSError: print('closed')\n"
        )
        said = docker("exec", service, "python3", "-c", probe, shape.gateway, shape.proxy_ip)
        assert said.stdout.split() == ["closed", "open"]
    finally:
        for run_id in launched:
            engine.remove(run_id)
    assert engine.runs_with_parts() == set()


# --- repair ---------------------------------------------------------------------------------


@pytest.mark.suite("faults")
@pytest.mark.docker
def test_a_stopped_proxy_is_found_and_replaced(state, egress_image):
    docker("stop", "--time", "5", state.shape.proxy_container)

    problems = preflight(state.shape, state.shape.image_id, RUNNER)
    assert any("exited" in p for p in problems), problems

    state.shape = ensure_shape(
        RUNNER, egress_image, NOWHERE, "x", environment=PROXY_ENV, ready_timeout=WAIT
    )
    assert preflight(state.shape, state.shape.image_id, RUNNER) == []


@pytest.mark.suite("faults")
@pytest.mark.docker
def test_a_removed_proxy_is_found_and_replaced(state, egress_image):
    old = state.shape.proxy_container_id
    docker("rm", "--force", state.shape.proxy_container)

    assert preflight(state.shape, state.shape.image_id, RUNNER) == [
        f"the proxy container {state.shape.proxy_container} is missing"
    ]

    state.shape = ensure_shape(
        RUNNER, egress_image, NOWHERE, "x", environment=PROXY_ENV, ready_timeout=WAIT
    )
    assert state.shape.proxy_container_id != old
    assert preflight(state.shape, state.shape.image_id, RUNNER) == []


@pytest.mark.docker
def test_a_proxy_on_another_image_under_the_same_tag_is_found_and_replaced(state, egress_image):
    first = state.shape.image_id
    # Another image now carries the tag (as after a rebuild): same content, one label more.
    holder = f"covey-isotest-{SESSION}-commit"
    docker("create", "--name", holder, "--label", TEST_LABEL, first)
    try:
        docker("commit", "--change", f"LABEL {TEST_LABEL}", holder, egress_image)
    finally:
        docker("rm", "--force", holder, check=False)
    second = image_id(egress_image)
    assert second != first

    problems = preflight(state.shape, second, RUNNER)
    assert any(f"the proxy runs image {first}, not the pinned {second}" in p for p in problems)

    state.shape = ensure_shape(
        RUNNER, egress_image, NOWHERE, "x", environment=PROXY_ENV, ready_timeout=WAIT
    )
    assert state.shape.image_id == second
    assert inspect(state.shape.proxy_container)["Image"] == second
    assert preflight(state.shape, second, RUNNER) == []
    # The pin holds the image, not the tag: it is the old ID that is now wrong.
    assert preflight(state.shape, first, RUNNER) != []


@pytest.mark.docker
def test_a_missing_rule_is_found_and_put_back(shape):
    subprocess.run(
        ["iptables", "-w", "10", "-D", "INPUT", "-i", shape.bridge,
         "-m", "comment", "--comment", f"covey:{RUNNER}", "-j", "DROP"],
        check=True,
    )  # fmt: skip

    problems = preflight(shape, shape.image_id, RUNNER)
    assert any(p.startswith("iptables INPUT: missing") for p in problems), problems

    ensure_rules(shape)
    assert check_rules(shape) == []
    assert preflight(shape, shape.image_id, RUNNER) == []


@pytest.mark.docker
def test_a_wrong_network_is_recreated_but_not_under_a_sandbox(egress_image):
    runner = f"{RUNNER}-w"
    name = isolation.internal_network_name(runner)
    sandbox = f"covey-isotest-{SESSION}-on-wrong"
    clean(runner)
    try:
        # An ordinary bridge under the internal network's name, with a container on it.
        docker("network", "create", "--label", TEST_LABEL, name)
        docker("create", "--name", sandbox, "--label", TEST_LABEL, "--network", name,
               "covey-base:trixie", "true")  # fmt: skip
        assert any("not internal" in p for p in isolation.check_shape(runner, "sha256:x"))

        with pytest.raises(IsolationError, match=f"{sandbox} are on it"):
            ensure_shape(runner, egress_image, NOWHERE, "x", environment=PROXY_ENV)
        assert inspect(name)["Internal"] is False  # left alone

        docker("rm", "--force", sandbox)
        shape = ensure_shape(
            runner, egress_image, NOWHERE, "x", environment=PROXY_ENV, ready_timeout=WAIT
        )
        assert inspect(name)["Internal"] is True
        assert preflight(shape, shape.image_id, runner) == []

        teardown(runner)
        assert leftovers(runner) == []
    finally:
        docker("rm", "--force", sandbox, check=False)
        clean(runner)


@pytest.mark.docker
def test_teardown_and_remove_rules_leave_nothing_behind(shape, engine):
    assert leftovers(RUNNER) != []
    engine_sandboxes = engine.sandboxes()
    assert engine_sandboxes == [] or all(s.status == "exited" for s in engine_sandboxes)
    for sandbox in engine_sandboxes:
        engine.remove(sandbox.run_id)

    teardown(RUNNER)
    remove_rules(RUNNER)  # nothing left to remove: fine

    assert leftovers(RUNNER) == []
    assert preflight(shape, shape.image_id, RUNNER) != []


def test_the_proxy_container_takes_the_hosts_proxy_settings():
    """Under hard isolation the proxy runs in a container the runner starts: what this host
    sets for it (its poll and deadlines, where it resolves, which private ranges it may reach, its
    metrics token) goes into the container, not the proxy's defaults."""
    from runners.host.config import HostSettings

    host = HostSettings.from_environment(
        {
            "COVEY_EGRESS_POLICY_POLL": "0.5",
            "COVEY_EGRESS_POLICY_GRACE": "7.5",
            "COVEY_EGRESS_HEAD_TIMEOUT": "12",
            "COVEY_EGRESS_NAMESERVERS": "10.0.0.2,10.0.0.3@5353",
            "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": "10.9.0.0/16",
            "COVEY_METRICS_TOKEN": "scrape-" + "m" * 32,
        }
    )
    assert host.proxy_environment == {
        "COVEY_EGRESS_POLICY_POLL": "0.5",
        "COVEY_EGRESS_POLICY_GRACE": "7.5",
        "COVEY_EGRESS_HEAD_TIMEOUT": "12",
        "COVEY_EGRESS_NAMESERVERS": "10.0.0.2,10.0.0.3@5353",
        "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": "10.9.0.0/16",
        "COVEY_METRICS_TOKEN": "scrape-" + "m" * 32,
    }
