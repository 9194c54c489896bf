"""What a workplace is made of, checked: packages per ecosystem and companion services.

Plain functions on JSON-shaped values (what the model's fields hold and the API carries), each
returning the value normalised or raising ValueError with a message that says what is wrong
and where. The runner host builds what these let through, so they are strict: nothing that
could be read as an option, a URL or a second command passes.
"""

import re
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from workplaces.images import validate_image_reference

# Ecosystems whose packages the runner host installs in a workplace's image (in this order:
# apt first, it may bring the runtimes the others need).
ECOSYSTEMS = ("apt", "pip", "npm")
ECOSYSTEM_NAMES = {
    "apt": "Debian packages (apt)",
    "pip": "Python packages (pip)",
    "npm": "Node.js packages (npm)",
}
ECOSYSTEM_FORMS = {
    "apt": "name, or name=version",
    "pip": "name, or name with a version specifier: name==1.2.3, name>=1,<2, name[extra]",
    "npm": "name, or name@version (a version, a range or a tag): name@1.2.3, @scope/name@^1",
}
MAX_PACKAGES = 200  # per ecosystem
MAX_SERVICES = 8

# Debian policy §5.6.1 (package names) and §5.6.12 (versions, with an optional epoch).
# Not ending in '-': `apt-get install name-` removes the package.
_APT_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]{0,61}[a-z0-9+.]")
_APT_VERSION = re.compile(r"(?:[0-9]+:)?[0-9][A-Za-z0-9.+~-]{0,99}")
# PEP 508 names; npm's (validate-npm-package-name, new packages: lower case, URL-safe). An npm
# version is a semver version, range or dist-tag: no ':' or '/' (URLs, git, file:, npm: aliases).
_PIP_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
# A pip specifier's version: PEP 440 characters only (with .* and a +local part).
_PIP_VERSION = re.compile(r"[A-Za-z0-9.*+!_-]{1,64}")
_PIP_OPERATORS = ("==", "!=", "<=", ">=", "<", ">", "~=")
# npm reads a spec that looks like a file (a tarball's suffix, a leading ~ or -) as a path.
_NPM_NAME = re.compile(r"(?:@[a-z0-9][a-z0-9._~-]*/)?[a-z0-9][a-z0-9._~-]*")
_NPM_VERSION = re.compile(r"[A-Za-z0-9.^~<>=|*+][A-Za-z0-9.^~<>=|*+ -]{0,99}")
_NPM_FILE = re.compile(r"\.(?:tgz|tar|tar\.gz|tar\.bz2|tar\.xz|zip)$", re.IGNORECASE)
# A service's name is its host name in the sandbox: one DNS label, lower case.
_SERVICE_NAME = re.compile(r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?")
_RESERVED_NAMES = frozenset({"localhost", "sandbox", "proxy", "covey"})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
SERVICE_KEYS = ("name", "image", "environment", "command", "ready", "cpus", "memory_mb")
READY_KEYS = ("command", "start_period", "interval", "timeout")
READY_DEFAULTS = {"start_period": 0.0, "interval": 1.0, "timeout": 60.0}
SERVICE_DEFAULTS = {"cpus": 1.0, "memory_mb": 512}

PACKAGES_RULE = (
    'Give packages as {"apt": ["name", "name=version", …], "pip": ["name==1.2.3", …],'
    ' "npm": ["name@1.2.3", …]}; ecosystems: ' + ", ".join(ECOSYSTEMS)
)
SERVICES_EXAMPLE = (
    '[{"name": "db", "image": "postgres:16", "environment": {"POSTGRES_PASSWORD": "test"},'
    ' "ready": {"command": ["pg_isready"], "interval": 1, "timeout": 60}}]'
)


def check_packages(value: Any) -> dict[str, list[str]]:
    """Packages per ecosystem, each list without repeats and sorted; empty lists dropped."""
    if value in (None, ""):
        return {}
    if not isinstance(value, dict):
        raise ValueError(PACKAGES_RULE)
    found: dict[str, list[str]] = {}
    for ecosystem, specs in value.items():
        if ecosystem not in ECOSYSTEMS:
            raise ValueError(
                f"{ecosystem!r} is not an ecosystem covey installs (it installs: "
                f"{', '.join(ECOSYSTEMS)})"
            )
        if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
            raise ValueError(f"{ecosystem}: give a list of package names")
        if len(specs) > MAX_PACKAGES:
            raise ValueError(f"{ecosystem}: at most {MAX_PACKAGES} packages")
        checked = sorted({check_package(ecosystem, spec.strip()) for spec in specs})
        names = [package_name(ecosystem, spec) for spec in checked]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"{ecosystem}: {', '.join(twice)} given with two versions")
        if checked:
            found[ecosystem] = checked
    return dict(sorted(found.items(), key=lambda item: ECOSYSTEMS.index(item[0])))


def check_package(ecosystem: str, spec: str) -> str:
    """One package of ``ecosystem`` as its installer takes it, normalised (ValueError if it is
    not one)."""
    if ecosystem == "apt":
        return check_apt_package(spec)
    if ecosystem == "pip":
        return check_pip_package(spec)
    if ecosystem == "npm":
        return check_npm_package(spec)
    raise ValueError(f"{ecosystem!r} is not an ecosystem covey installs")


def package_name(ecosystem: str, spec: str) -> str:
    """The name in a checked ``spec`` (what two specs of one package share)."""
    if ecosystem == "pip":
        return canonicalize_name(re.split(r"[\[=<>!~ ]", spec, maxsplit=1)[0])
    if ecosystem == "npm":
        at = spec.find("@", 1)
        return spec if at < 0 else spec[:at]
    return spec.split("=")[0]


def is_bare(ecosystem: str, spec: str) -> bool:
    """Whether ``spec`` names a package without asking for a version."""
    return spec == package_name(ecosystem, spec)


def check_apt_package(spec: str) -> str:
    """``name`` or ``name=version``, as apt-get install takes them."""
    name, has_version, version = spec.partition("=")
    if not _APT_NAME.fullmatch(name):
        raise ValueError(
            f"apt: {spec!r} is not a Debian package name (lower case letters, digits and"
            " + . -, starting with a letter or digit, not ending in -, at least two characters)"
        )
    if has_version and not _APT_VERSION.fullmatch(version):
        raise ValueError(f"apt: {version!r} in {spec!r} is not a Debian version")
    return spec


def check_pip_package(spec: str) -> str:
    """A PEP 508 requirement without a URL or an environment marker (an index's package in
    versions the specifier allows), normalised: the canonical name, extras sorted."""
    if len(spec) > 200:
        raise ValueError(f"pip: {spec[:40]!r}… is longer than 200 characters")
    try:
        requirement = Requirement(spec)
    except InvalidRequirement as exc:
        why = str(exc).splitlines()[0]
        raise ValueError(
            f"pip: {spec!r} is not a requirement ({ECOSYSTEM_FORMS['pip']}): {why}"
        ) from None
    if requirement.url or "@" in spec:
        raise ValueError(f"pip: {spec!r} names a URL; give a package of the index")
    if requirement.marker is not None or ";" in spec:
        raise ValueError(f"pip: {spec!r} has an environment marker; give the package alone")
    if not _PIP_NAME.fullmatch(requirement.name):
        raise ValueError(f"pip: {requirement.name!r} is not a package name")
    for specifier in requirement.specifier:
        # '===' compares as text, and pip reads anything with a slash as a path on the host.
        if specifier.operator not in _PIP_OPERATORS or not _PIP_VERSION.fullmatch(
            specifier.version
        ):
            raise ValueError(
                f"pip: {str(specifier)!r} in {spec!r} is not a version specifier covey takes"
                f" (operators {', '.join(_PIP_OPERATORS)}, and a PEP 440 version)"
            )
    extras = ",".join(sorted({canonicalize_name(extra) for extra in requirement.extras}))
    extras = f"[{extras}]" if extras else ""
    return f"{canonicalize_name(requirement.name)}{extras}{requirement.specifier}"


def check_npm_package(spec: str) -> str:
    """``name`` or ``name@version`` (a version, a range or a dist-tag): a registry's package,
    never a URL, a path, a git repository or an alias."""
    at = spec.find("@", 1)
    name, version = (spec, "") if at < 0 else (spec[:at], spec[at + 1 :].strip())
    if _NPM_FILE.search(name) or _NPM_FILE.search(version):
        raise ValueError(f"npm: {spec!r} names a file; give a package of the registry")
    if not _NPM_NAME.fullmatch(name) or len(name) > 214:
        raise ValueError(
            f"npm: {name!r} is not a package name (lower case letters, digits and - . _ ~,"
            " starting with a letter or digit, optionally @scope/; at most 214 characters)"
        )
    if at < 0:
        return name
    if not _NPM_VERSION.fullmatch(version):
        raise ValueError(
            f"npm: {version!r} in {spec!r} is not a version, a range or a tag of the registry"
            " (no URLs, paths, git repositories or aliases)"
        )
    return f"{name}@{version}"


def check_services(value: Any) -> list[dict[str, Any]]:
    """Companion services, each with every key (defaults filled in), in the order given."""
    if value in (None, ""):
        return []
    if not isinstance(value, list):
        raise ValueError(f"give services as a JSON list, e.g. {SERVICES_EXAMPLE}")
    if len(value) > MAX_SERVICES:
        raise ValueError(f"at most {MAX_SERVICES} services")
    services = [check_service(item, i) for i, item in enumerate(value)]
    names = [service["name"] for service in services]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"two services are named {', '.join(twice)}: each name is a host name")
    return services


def check_service(value: Any, index: int = 0) -> dict[str, Any]:
    where = f"service {index + 1}"
    if not isinstance(value, dict):
        raise ValueError(f"{where}: give an object, e.g. {SERVICES_EXAMPLE}")
    unknown = sorted(set(value) - set(SERVICE_KEYS))
    if unknown:
        known = ", ".join(SERVICE_KEYS)
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)} (known: {known})")
    name = value.get("name")
    if not isinstance(name, str) or not _SERVICE_NAME.fullmatch(name):
        raise ValueError(
            f"{where}: its name is its host name in the sandbox: one DNS label of lower-case"
            f" letters, digits and hyphens, starting with a letter (got {name!r})"
        )
    where = f"service {name}"
    if name in _RESERVED_NAMES:
        raise ValueError(f"{where}: the name {name} is reserved")
    image = value.get("image")
    if not isinstance(image, str):
        raise ValueError(f"{where}: give its image")
    try:
        validate_image_reference(image)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return {
        "name": name,
        "image": image,
        "environment": _environment(value.get("environment"), where),
        "command": check_command(value.get("command"), f"{where}: command", empty=True),
        "ready": _ready(value.get("ready"), where),
        "cpus": _number(value, "cpus", where, 0.01, 64.0, SERVICE_DEFAULTS),
        "memory_mb": int(_number(value, "memory_mb", where, 16, 64 * 1024, SERVICE_DEFAULTS)),
    }


def _environment(value: Any, where: str) -> dict[str, str]:
    if value in (None, ""):
        return {}
    if not isinstance(value, dict):
        raise ValueError(f'{where}: give its environment as an object, {{"NAME": "value"}}')
    for key, text in value.items():
        if not _ENV_NAME.fullmatch(key):
            raise ValueError(f"{where}: {key!r} is not an environment variable name")
        if not isinstance(text, str) or "\0" in text:
            raise ValueError(f"{where}: {key} must be text (without NUL)")
    return dict(sorted(value.items()))


def check_command(value: Any, where: str, *, empty: bool) -> list[str]:
    """A command as a list of non-empty argument strings without NUL (``empty``: [] allowed)."""
    if value in (None, "") or value == []:
        if empty:
            return []
        raise ValueError(f"{where}: give a command")
    if not isinstance(value, list) or not all(
        isinstance(arg, str) and arg and "\0" not in arg for arg in value
    ):
        raise ValueError(
            f'{where}: give a JSON list of arguments, e.g. ["pg_isready", "-h", "localhost"]'
        )
    return list(value)


def _ready(value: Any, where: str) -> dict[str, Any] | None:
    """The readiness check (None: ready once started)."""
    if value in (None, ""):
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: give its readiness check as an object with a command")
    unknown = sorted(set(value) - set(READY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown readiness keys {', '.join(unknown)}")
    checked = f"{where}: readiness"
    return {
        "command": check_command(value.get("command"), f"{checked} command", empty=False),
        "start_period": _number(value, "start_period", checked, 0, 600, READY_DEFAULTS),
        "interval": _number(value, "interval", checked, 0.1, 60, READY_DEFAULTS),
        "timeout": _number(value, "timeout", checked, 1, 3600, READY_DEFAULTS),
    }


def _number(
    value: dict[str, Any], key: str, where: str, low: float, high: float, defaults: dict[str, Any]
) -> float:
    number = value.get(key, defaults[key])
    if isinstance(number, bool) or not isinstance(number, int | float) or not low <= number <= high:
        raise ValueError(f"{where}: {key} must be a number from {low:g} to {high:g}")
    return float(number)
