"""covey's declared and locked dependencies (pyproject.toml, requirements/), for the tests that
check images and declarations against them."""

import re
import tomllib
from functools import cache

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.processes import ROOT


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def declared(group: str | None = None) -> set[str]:
    """The names in [project].dependencies (None) or in a dependency group, canonical."""
    if group is None:
        entries = pyproject()["project"]["dependencies"]
    else:
        entries = [e for e in pyproject()["dependency-groups"][group] if isinstance(e, str)]
    return {canonicalize_name(Requirement(entry).name) for entry in entries}


@cache
def locked(name: str) -> dict[str, str]:
    """requirements/<name>.txt as canonical name → version."""
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", (
        ROOT / "requirements" / f"{name}.txt"
    ).read_text(), re.M)  # fmt: skip
    return {canonicalize_name(n): v for n, v in pins}


def dev_only() -> set[str]:
    """What only development needs: in the dev lock and not in the control plane's."""
    return set(locked("dev")) - set(locked("control-plane"))
