"""The runner host as a process of its own: its settings from the environment, its Celery
worker with orders bound to its host, and that it starts where Django is not installed."""

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from celery import Celery

from runners import dispatch
from runners.host import worker
from runners.host.config import HostSettings
from runners.host.process import HostError, check
from runners.probe.checks import Targets
from runners.protocol import CANCEL, HOME, LAUNCH, PROBE, RENEW, Order, ProtocolError
from tests.locks import locked
from tests.processes import ROOT

ORDERS = (LAUNCH, CANCEL, RENEW, PROBE, HOME)


class Host:
    """Stands for a RunnerHost: what its orders asked of it."""

    def __init__(self) -> None:
        self.done: list[tuple[str, int, str]] = []

    def launch(self, runner_id: int, run_id: str) -> None:
        self.done.append(("launch", runner_id, run_id))

    def cancel(self, runner_id: int, run_id: str) -> None:
        self.done.append(("cancel", runner_id, run_id))

    def renew_token(self, runner_id: int, sealed: str) -> None:
        self.done.append(("renew", runner_id, sealed))

    def probe(self, runner_id: int, probe_id: str) -> None:
        self.done.append(("probe", runner_id, probe_id))

    def home(self, runner_id: int, operation_id: str) -> None:
        self.done.append(("home", runner_id, operation_id))


def test_each_worker_carries_out_orders_on_the_host_it_was_made_for(tmp_path):
    first, second = Host(), Host()
    settings = HostSettings(homes=tmp_path, var_dir=tmp_path, broker_url="memory://")
    apps = (worker.make_app(first, settings), worker.make_app(second, settings))
    apps[0].tasks[LAUNCH](3, "r-1")
    apps[1].tasks[CANCEL](4, "r-2")
    apps[1].tasks[PROBE](4, "p-1")
    apps[0].tasks[HOME](3, "op-1")
    apps[0].tasks[RENEW](3, "sealed")
    assert first.done == [("launch", 3, "r-1"), ("home", 3, "op-1"), ("renew", 3, "sealed")]
    assert second.done == [("cancel", 4, "r-2"), ("probe", 4, "p-1")]


def test_the_worker_refuses_a_malformed_order_naming_it_and_acts_on_none_of_it(tmp_path):
    host = Host()
    app = worker.make_app(host, HostSettings(homes=tmp_path, broker_url="memory://"))
    with pytest.raises(ProtocolError, match=r"covey\.runner\.launch: Order\.runner: expected int"):
        app.tasks[LAUNCH]("3", "r-1")
    with pytest.raises(ProtocolError, match=r"covey\.runner\.probe: Order\.subject: expected str"):
        app.tasks[PROBE](3, None)
    with pytest.raises(ProtocolError, match=r"covey\.runner\.home: Order\.runner: expected int"):
        app.tasks[HOME](True, "op-1")
    assert host.done == []


def test_orders_keep_the_arguments_a_runner_one_version_back_takes():
    """Its tasks take (runner id, subject), positionally, as the control plane sends them."""
    assert Order(3, "r-1").args() == [3, "r-1"]
    assert Order.from_args(LAUNCH, 3, "r-1") == Order(3, "r-1")


def test_the_worker_takes_the_task_names_the_control_plane_sends_and_has_no_django(tmp_path):
    app = worker.make_app(Host(), HostSettings(homes=tmp_path, broker_url="memory://"))
    assert {LAUNCH, CANCEL, RENEW, PROBE, HOME} <= set(app.tasks)
    # What runners one version back listen for: the names never change.
    assert (dispatch.LAUNCH, dispatch.CANCEL, dispatch.RENEW, dispatch.PROBE, dispatch.HOME) == (
        "covey.runner.launch",
        "covey.runner.cancel",
        "covey.runner.renew_token",
        "covey.runner.probe",
        "covey.runner.home",
    )
    assert isinstance(app, Celery) and app.fixups == []  # no Django fix-up
    assert app.tasks[LAUNCH].acks_late and not app.tasks[HOME].acks_late


def test_the_file_system_broker_is_made_in_the_hosts_directory(tmp_path):
    app = worker.make_app(Host(), HostSettings(homes=tmp_path, var_dir=tmp_path))
    assert app.conf.broker_transport_options["data_folder_in"] == str(tmp_path / "broker/queue")
    assert all((tmp_path / "broker" / name).is_dir() for name in ("queue", "processed", "control"))


def test_the_settings_are_read_from_the_environment(tmp_path):
    sources = tmp_path / "sources.list"
    settings = HostSettings.from_environment(
        {
            "COVEY_VAR_DIR": str(tmp_path),
            "COVEY_RUNNER_PROXY": "proxy.internal:3128",
            "COVEY_EGRESS_ISOLATION": "network",
            "COVEY_EGRESS_POLICY_GRACE": "7",
            "COVEY_EGRESS_NAMESERVERS": "10.0.0.53,10.0.0.54",
            "COVEY_METRICS_TOKEN": "metrics-secret",
            "COVEY_EGRESS_PROBE_INTERNET": "192.0.2.1:443",
            "COVEY_RUNNER_PROXY_WAIT_SECONDS": "2.5",
            "COVEY_WORKPLACE_APT_SOURCES": str(sources),
            "CELERY_BROKER_URL": "redis://127.0.0.1:6379/3",
            "COVEY_RUNNER_HEARTBEAT_SECONDS": "0.5",
        }
    )
    assert settings.homes == tmp_path / "homes"
    assert settings.var_dir == tmp_path
    assert settings.proxy == "proxy.internal:3128"
    assert settings.hard and settings.isolation == "network"
    assert settings.proxy_environment == {
        "COVEY_EGRESS_POLICY_POLL": "0.25",
        "COVEY_EGRESS_POLICY_GRACE": "7",
        "COVEY_EGRESS_HEAD_TIMEOUT": "60",
        "COVEY_EGRESS_NAMESERVERS": "10.0.0.53,10.0.0.54",
        "COVEY_METRICS_TOKEN": "metrics-secret",
    }
    assert settings.probe_targets.internet == ("192.0.2.1:443",)
    assert settings.probe_targets.private == Targets().private
    assert settings.proxy_wait == 2.5 and settings.heartbeat == 0.5
    assert settings.apt_sources == sources
    assert settings.broker_url == "redis://127.0.0.1:6379/3"
    assert "metrics-secret" not in repr(settings) and "6379" not in repr(settings)


def test_without_an_environment_the_settings_are_the_defaults(tmp_path):
    settings = HostSettings.from_environment({"COVEY_VAR_DIR": str(tmp_path)})
    assert settings == HostSettings(
        homes=tmp_path / "homes",
        var_dir=tmp_path,
        proxy_environment={
            "COVEY_EGRESS_POLICY_POLL": "0.25",
            "COVEY_EGRESS_POLICY_GRACE": "15",
            "COVEY_EGRESS_HEAD_TIMEOUT": "60",
        },
    )


def test_a_value_of_the_wrong_kind_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"COVEY_RUNNER_PROXY_WAIT_SECONDS|could not convert"):
        HostSettings.from_environment({"COVEY_RUNNER_PROXY_WAIT_SECONDS": "soon"})


def test_an_unknown_isolation_level_stops_the_host_at_start_and_is_never_hard(tmp_path):
    settings = HostSettings.from_environment(
        {"COVEY_VAR_DIR": str(tmp_path), "COVEY_EGRESS_ISOLATION": "netwrok"}
    )
    assert not settings.hard
    with pytest.raises(HostError, match="COVEY_EGRESS_ISOLATION is 'netwrok'"):
        check(settings)


def test_a_proxy_container_that_would_refuse_between_polls_stops_the_host_at_start(tmp_path):
    settings = HostSettings.from_environment(
        {"COVEY_VAR_DIR": str(tmp_path), "COVEY_EGRESS_POLICY_GRACE": "0.25"}
    )
    with pytest.raises(
        HostError, match=r"its proxy container: COVEY_EGRESS_POLICY_GRACE \(0.25 s\)"
    ):
        check(settings)


def runner_environment(where: Path) -> Path:
    """A virtualenv with no access to the system's packages holding exactly the runner lock's
    distributions (linked from this one's): a Python where Django is not installed."""
    subprocess.run(
        [sys._base_executable, "-m", "venv", "--without-pip", str(where)],  # type: ignore[attr-defined]
        check=True,
        timeout=120,
    )
    site = Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
    lock = (ROOT / "requirements" / "runner.txt").read_text()
    for name in locked("runner"):
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            # Only what this platform does not install (pywin32 on Linux) may be missing.
            assert re.search(rf"^{re.escape(name)}==\S+ ; ", lock, re.M | re.I), name
            continue
        tops = {Path(str(f)).parts[0] for f in distribution.files or () if ".." not in str(f)}
        for top in tops:
            target = Path(str(distribution.locate_file(top)))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
    return where / "bin" / "python"


def test_the_runner_host_starts_where_django_is_not_installed(tmp_path):
    python = runner_environment(tmp_path / "venv")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV")
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    no_django = run("-c", "import django")
    assert no_django.returncode != 0 and "No module named 'django'" in no_django.stderr
    shown = run("-m", "runners.host", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "--builtin" in shown.stdout and "--remove-sandboxes-at-exit" in shown.stdout
    # Everything the process runs is importable there, and its settings are read.
    loaded = run(
        "-c",
        "import sys, runners.host.__main__, runners.host.process, runners.host.worker;"
        " from runners.host.config import HostSettings; HostSettings.from_environment();"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'covey')))",
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
