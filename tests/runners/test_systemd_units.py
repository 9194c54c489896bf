"""The systemd units docs/runners.md installs (deploy/systemd/): systemd itself accepts them, and
the commands they start take the options they give (with this checkout standing in for
/opt/covey)."""

import configparser
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.processes import ROOT

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
INSTALLED = "/opt/covey"


def service(unit: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(unit.read_text())
    return parser["Service"]


def test_the_units_are_the_runner_and_its_proxy():
    assert [unit.name for unit in UNITS] == ["covey-egress-proxy.service", "covey-runner.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_systemd_accepts_the_unit(unit, tmp_path):
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no systemd-analyze on this machine (Debian: the systemd package)")
        pytest.skip("no systemd-analyze on this machine")
    here = tmp_path / unit.name
    here.write_text(unit.read_text().replace(INSTALLED, str(ROOT)))
    checked = subprocess.run(
        ["systemd-analyze", "verify", str(here)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_the_command_it_starts_takes_its_options(unit):
    section = service(unit)
    assert section["WorkingDirectory"] == INSTALLED
    assert section["EnvironmentFile"] == "/etc/covey/runner.env"
    command = shlex.split(section["ExecStart"].replace(INSTALLED, str(ROOT)))
    assert command[0] == str(ROOT / ".venv" / "bin" / "python")
    options = [word for word in command if word.startswith("--")]
    assert options, command
    # Each option it passes is one the program (python -m runners.host, python -m
    # egress.proxy) offers: its --help lists it.
    program = command[:3]
    shown = subprocess.run(
        [*program, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    for option in options:
        assert option in shown.stdout, (option, shown.stdout)
