"""The import contracts (pyproject.toml, [tool.importlinter]) hold for the code as it is, and
fail when an import goes the wrong way, inside a function too: checked on a copy of the tree."""

import shutil
import subprocess
import tomllib

import pytest

from tests.processes import ROOT, VENV_BIN

PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
    "root_packages"
]


@pytest.fixture
def tree(tmp_path):
    """A copy of covey's packages and pyproject.toml, to break on purpose."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def lint(tree) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "lint-imports"), "--no-cache"],
        cwd=tree, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_contracts_hold_and_a_wrong_way_import_breaks_them(tree):
    assert lint(tree).returncode == 0
    # The root app reaching up, inside a function where a cycle would once have been dodged.
    (tree / "organisations" / "shortcut.py").write_text(
        "def place_now():\n    from runs.services import place_waiting\n\n    place_waiting()\n"
    )
    broken = lint(tree)
    assert broken.returncode == 1
    assert "organisations is not allowed to import runs" in broken.stdout
    assert "organisations.shortcut -> runs.services" in broken.stdout


def test_django_in_the_data_plane_breaks_them(tree):
    (tree / "egress" / "proxy" / "relay.py").write_text(
        (tree / "egress" / "proxy" / "relay.py").read_text()
        + "\n\ndef later():\n    import django\n"
    )
    broken = lint(tree)
    assert broken.returncode == 1
    assert "egress.proxy is not allowed to import django" in broken.stdout
    assert "egress.proxy.relay -> django" in broken.stdout


def test_an_app_imported_by_covey_s_shared_modules_breaks_them(tree):
    # What organisations/readonly.py holds was once here: the shared modules sit below the apps.
    (tree / "covey" / "versions.py").write_text(
        (tree / "covey" / "versions.py").read_text()
        + "\n\nfrom organisations.admin import MembersRead  # noqa: E402\n"
    )
    broken = lint(tree)
    assert broken.returncode == 1
    assert "covey.versions is not allowed to import organisations" in broken.stdout
    assert "covey.versions -> organisations.admin" in broken.stdout


def test_a_layer_that_names_the_addon_even_for_a_type_breaks_them(tree):
    layers = tree / "egress" / "proxy" / "layers.py"
    layers.write_text(
        layers.read_text()
        + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        + "    from egress.proxy.addon import CoveyEgress\n"
    )
    broken = lint(tree)
    assert broken.returncode == 1
    assert "egress.proxy.layers is not allowed to import egress.proxy.addon" in broken.stdout
