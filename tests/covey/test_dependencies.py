"""Dependencies the Python way: what the code imports is declared, what is declared is locked,
and the locks agree (no index needed: the locks are read, not remade)."""

import importlib.metadata

import grimp
import pytest
from packaging.utils import canonicalize_name

from tests.locks import declared, dev_only, locked, pyproject

ROOTS = pyproject()["tool"]["importlinter"]["root_packages"]
# Installed apps and servers named in settings and the Procfile rather than imported.
BY_NAME = {
    "django-filter", "drf-spectacular-sidecar", "whitenoise", "gunicorn", "honcho", "psycopg",
    "celery",
}  # fmt: skip


def distributions_imported_by(modules: set[str], graph: grimp.ImportGraph) -> set[str]:
    """The distributions that provide the outside packages these modules import."""
    provided = importlib.metadata.packages_distributions()
    outside = {m for m in graph.modules if m.split(".")[0] not in ROOTS and "." not in m}
    used = {m for m in outside if any(graph.direct_import_exists(importer=i, imported=m)
                                      for i in modules)}  # fmt: skip
    return {canonicalize_name(d) for m in used for d in provided.get(m, [])}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOTS, include_external_packages=True)


def test_every_outside_package_the_code_imports_is_a_declared_dependency(graph):
    ours = {m for m in graph.modules if m.split(".")[0] in ROOTS}
    assert distributions_imported_by(ours, graph) <= declared()
    assert declared() >= BY_NAME


def test_the_proxy_group_is_exactly_what_the_proxy_imports(graph):
    proxy = {"egress.proxy", *graph.find_descendants("egress.proxy")}
    proxy |= {m for m in graph.find_upstream_modules("egress.proxy", as_package=True)
              if m.split(".")[0] in ROOTS}  # fmt: skip
    assert distributions_imported_by(proxy, graph) == declared("proxy")
    assert declared("proxy") <= declared()


def test_the_runner_group_is_exactly_what_the_runner_host_imports_and_no_django(graph):
    host = {"runners.host", *graph.find_descendants("runners.host")}
    host |= {m for m in graph.find_upstream_modules("runners.host", as_package=True)
             if m.split(".")[0] in ROOTS}  # fmt: skip
    assert distributions_imported_by(host, graph) == declared("runner")
    assert declared("runner") <= declared()
    assert "redis" in locked("runner")  # celery[redis]: the broker of a production runner
    assert not {"django", "djangorestframework"} & set(locked("runner"))


@pytest.mark.parametrize(
    ("lock", "group"), [("control-plane", None), ("proxy", "proxy"), ("runner", "runner")]
)
def test_each_lock_holds_what_it_is_locked_from_at_the_dev_locks_versions(lock, group):
    assert declared(group) <= set(locked(lock))
    dev = locked("dev")
    assert {
        name: version for name, version in locked(lock).items() if dev.get(name) != version
    } == {}


def test_the_dev_lock_holds_the_tools_and_no_image_lock_does():
    assert declared("dev") <= set(locked("dev"))
    tools = {"mypy", "ruff", "pytest", "import-linter", "playwright", "factory-boy"}
    assert tools <= dev_only()
    assert not tools & set(locked("proxy"))
