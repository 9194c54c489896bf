"""The API fuzzed from its own OpenAPI schema (schemathesis) on the real web process, as every
kind of caller: nobody, a viewer, an approver and an admin of the organisation, an admin of
another one, a runner (its token), and an egress token passed off as an API token. No request
may get a server error (a 503 only where the schema says so), no answer may break the schema,
and no answer to an outsider may name anything of the organisation's."""

import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from rest_framework.authtoken.models import Token
from schemathesis.specs.openapi.checks import response_schema_conformance

from agents import services as agent_services
from egress.services import issue_token
from organisations.models import Membership, Role
from tests.egress.conftest import subprocess_database_url
from tests.factories import OrganisationFactory, UserFactory, online_runner
from tests.processes import control_plane

pytestmark = [
    pytest.mark.e2e,  # a control plane of its own: among the first to run
    pytest.mark.suite("api-fuzz"),
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

EXAMPLES = int(os.environ.get("COVEY_FUZZ_EXAMPLES", "6"))  # per operation and caller
# What only the organisation's own people may see: in no answer to anyone else.
SECRET_NAME = "Zeta-Fuzz-Owned-Name"
INSIDERS = ("viewer", "approver", "admin", "runner")  # the organisation's own


def callers(owner, outsider) -> dict[str, dict[str, str]]:
    """Every kind of caller, by the header that says who they are."""

    def member(organisation, name: str, role: str) -> dict[str, str]:
        user: Any = UserFactory(username=name)
        Membership.objects.create(organisation=organisation, user=user, role=role)
        return {"Authorization": f"Token {Token.objects.create(user=user).key}"}

    agent = agent_services.create_agent(owner, SECRET_NAME.lower(), allowlist=["a.example"])
    _, egress = issue_token(agent)
    _, runner_token = online_runner(owner, name=f"{SECRET_NAME.lower()}-runner")
    _, other_runner = online_runner(outsider, name="fuzz-outsiders-runner")
    return {
        "nobody": {},
        "viewer": member(owner, "fuzz-viewer", Role.VIEWER),
        "approver": member(owner, "fuzz-approver", Role.APPROVER),
        "admin": member(owner, "fuzz-admin", Role.ADMIN),
        "outsider": member(outsider, "fuzz-outsider", Role.ADMIN),
        "runner": {"Authorization": f"Runner {runner_token}"},
        "outsiders-runner": {"Authorization": f"Runner {other_runner}"},
        "egress-token-as-api": {"Authorization": f"Token {egress.split(':', 1)[1]}"},
    }


def gist(failed: BaseExceptionGroup) -> str:
    """What schemathesis found, in a line: the value that broke the schema, and where."""
    lines = [line.strip() for line in str(failed.exceptions[0]).splitlines()]
    said = [line for line in lines if line.startswith(("Schema at", "- ST")) or " is " in line]
    return "; ".join(said[:3])[:300]


def documented(case: Any, status: int) -> bool:
    responses = case.operation.definition.raw.get("responses", {})
    return str(status) in responses


def test_no_caller_gets_a_server_error_an_answer_off_the_schema_or_anothers_data(tmp_path, cases):
    owner = OrganisationFactory(name=SECRET_NAME)
    outsider = OrganisationFactory(name="Fuzz Outsider")
    who = callers(owner, outsider)
    failures: list[str] = []
    with control_plane(tmp_path, subprocess_database_url()) as url:
        # Both schemas: the public API's and what runners and proxies call.
        operations = [
            found
            for part in ("", "internal/")
            for found in schemathesis.openapi.from_dict(
                httpx.get(f"{url}/api/v1/schema/{part}?format=json", headers=who["admin"]).json()
            ).get_all_operations()
        ]
        for found in operations:
            operation = found.ok()

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],  # report, do not shrink (a live server)
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def fuzz(case: Any) -> None:
                for name, headers in who.items():
                    cases.add()
                    label = f"{name}: {case.method} {case.formatted_path}"
                    try:
                        response = case.call(base_url=url, headers=headers, timeout=30)
                    except Exception as exc:  # the connection broke: as bad as a 500
                        failures.append(f"{label}: no answer ({type(exc).__name__}: {exc})")
                        continue
                    status = response.status_code
                    if status >= 500 and not (status == 503 and documented(case, status)):
                        failures.append(f"{label}: {status} {response.text[:200]}")
                        continue
                    if name not in INSIDERS and SECRET_NAME.lower() in (response.text.lower()):
                        failures.append(f"{label}: {status} names the organisation's own")
                    if status < 400 or documented(case, status):
                        try:
                            case.validate_response(response, checks=[response_schema_conformance])
                        except BaseExceptionGroup as exc:  # schemathesis says what failed
                            failures.append(f"{label}: {status} off the schema: {gist(exc)}")

            fuzz()
    cases.note(f"{len(who)} kinds of caller, {EXAMPLES} examples per operation and caller")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(sorted(set(failures))[:60])
