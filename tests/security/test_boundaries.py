"""Tenant and privilege boundaries, for every operation of the API's schema that names an
object and every runner endpoint, with an object of each kind of one organisation (acme):

- an admin of another organisation (gary) gets 404 for all of them, whatever the method: never
  a 403 that confirms the object exists, never a 2xx;
- a viewer of acme changes nothing (403 on every write; reads answer);
- nobody signed in gets 401 everywhere but the runner registration;
- a runner token of another organisation gets 404 for acme's runs, home operations, probes
  and requests; an API token used as a runner token, an egress credential used as an API
  token, and a revoked or unknown token get 401.
"""

import uuid
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from agents import services as agent_services
from approvals import services as approvals
from budgets import metering
from budgets import services as budgets
from budgets.usage import Usage
from connections.models import CredentialedRequest
from connections.services import create_connection
from egress.models import EgressToken
from egress.services import issue_token, revoke_tokens
from homes.models import HomeOperation
from organisations.models import Membership
from runners.models import Probe
from runners.services import renew_runner_tokens
from runs import services as runs
from tests.factories import WorkplaceFactory, decision_event, online_runner, record_events

pytestmark = [pytest.mark.suite("boundaries"), pytest.mark.django_db]

METHODS = ("get", "post", "put", "patch", "delete")
WRITES = ("post", "put", "patch", "delete")
SONNET = "claude-sonnet-4-5-20250929"


def operations() -> list[tuple[str, str]]:
    """(path, method) of every API operation, from the schema the API serves."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return [(p, m) for p, item in schema["paths"].items() for m in item if m in METHODS]


@pytest.fixture
def things(acme, alice) -> dict[str, Any]:
    """One of each kind of acme's objects, by the placeholder and resource naming it."""
    agent = agent_services.create_agent(acme, "Bounded", allowlist=["a.example"])
    runner, runner_token = online_runner(acme)
    budgets.set_budget(agent, Decimal(5))
    held = metering.reserve(agent, model=SONNET, input_bound=10, max_tokens=10, request_id="b1")
    charge = metering.settle(held, Usage(input=5, output=5))
    record_events([decision_event(agent)])
    token, credentials = issue_token(agent)
    request = approvals.file_egress(agent, "b.example", reason="boundaries", by=alice)
    run = runs.queue_run(agent, "boundaries")
    operation = HomeOperation.objects.create(
        id=uuid.uuid4(), agent=agent, runner=runner, kind="list", order={}
    )
    from budgets.models import Budget
    from egress.models import Decision

    workplace: Any = WorkplaceFactory(organisation=acme)
    connection = create_connection(acme, "git", "token", "tok", git_url="https://git.example")
    recorded = CredentialedRequest.objects.create(
        organisation=acme, agent=agent, run=run, connection=connection, at=timezone.now(),
        method="GET", host="git.example", repository="acme/app", service="git-upload-pack",
        status=200,
    )  # fmt: skip
    return {
        "connections": connection.pk,
        "credentialed-requests": recorded.pk,
        "agents": agent.pk,
        "workplaces": workplace.pk,
        "budgets": Budget.objects.get(agent=agent).pk,
        "charges": charge.request_id,
        "egress-decisions": Decision.objects.get(agent=agent).pk,
        "egress-tokens": token.pk,
        "memberships": Membership.objects.get(user=alice).pk,
        "organisations": acme.pk,
        "requests": request.pk,
        "package-requests": request.pk,
        "runners": runner.pk,
        "runs": run.pk,
        "runner/home": operation.pk,
        "runner/probes": Probe.objects.create(runner=runner).pk,
        "runner/requests": request.pk,
        "runner/runs": run.pk,
        "credentials": credentials,
        "runner_token": runner_token,
        "allowlist-templates": "npm",
    }


def filled(path: str, things: dict[str, Any], *, missing: bool = False) -> str | None:
    """The path with acme's object of its kind in it, or (``missing``) one of that kind that
    does not exist; None: it names no object."""
    if "{" not in path:
        return None
    rest = path.removeprefix("/api/v1/")
    resource = "/".join(rest.split("/")[:2]) if rest.startswith("runner/") else rest.split("/")[0]
    start, end = path.index("{"), path.index("}")
    value = things[resource]
    if missing:
        value = (
            uuid.UUID(int=1)
            if isinstance(value, uuid.UUID)
            else ("no-such-thing" if isinstance(value, str) else 987654321)
        )
    return path[:start] + str(value) + path[end + 1 :]


def call(client: APIClient, method: str, path: str) -> int:
    return getattr(client, method)(path, {}, format="json").status_code


def test_another_organisations_admin_finds_nothing_of_acmes(api, gary, things, cases):
    """Acme's object answers exactly as one that does not exist: 404 for a read, and for a
    write whatever a missing object gets (a write refused before any look-up says nothing)."""
    client = api(gary)
    found = []
    for path, method in operations():
        url = filled(path, things)
        if url is None or path.startswith(("/api/v1/runner/", "/api/v1/allowlist-templates/")):
            continue  # runner endpoints: below; templates are everyone's
        cases.add()
        status = call(client, method, url)
        nothing = call(client, method, filled(path, things, missing=True) or url)
        if status != nothing or (method == "get" and status != 404) or status < 300:
            found.append(f"{method.upper()} {url}: {status} (a missing one: {nothing})")
    assert found == []


def test_a_viewer_changes_nothing(api, vera, things, cases):
    client = api(vera)
    changed = []
    for path, method in operations():
        url = filled(path, things) or path
        if method not in WRITES or path.startswith("/api/v1/runner"):
            continue
        cases.add()
        status = call(client, method, url)
        if status < 300 or status >= 500:
            changed.append(f"{method.upper()} {url}: {status}")
    assert changed == []


def test_nobody_signed_in_gets_anything(things, cases):
    client = APIClient()
    let_in = []
    for path, method in operations():
        url = filled(path, things) or path
        if path in ("/api/v1/runners/register/", "/api/v1/schema/"):
            continue  # a registration token is the credential; the schema is public
        cases.add()
        if (status := call(client, method, url)) not in (401, 403):
            let_in.append(f"{method.upper()} {url}: {status}")
    assert let_in == []


def test_runner_endpoints_answer_only_their_own_runner(api, globex, alice, things, cases):
    _, theirs = online_runner(globex, name="theirs")
    outsider = APIClient()
    outsider.credentials(HTTP_AUTHORIZATION=f"Runner {theirs}")
    api_token_as_runner = APIClient()
    key = Token.objects.get_or_create(user=alice)[0].key
    api_token_as_runner.credentials(HTTP_AUTHORIZATION=f"Runner {key}")
    egress_as_api = APIClient()
    egress_as_api.credentials(HTTP_AUTHORIZATION=f"Token {things['credentials'].split(':', 1)[1]}")
    unknown = APIClient()
    unknown.credentials(HTTP_AUTHORIZATION=f"Runner {'x' * 40}")
    wrong = []
    for path, method in operations():
        if not path.startswith("/api/v1/runner/"):
            continue
        url = filled(path, things) or path
        for client, expected in ((api_token_as_runner, 401), (unknown, 401)):
            cases.add()
            if (status := call(client, method, url)) != expected:
                wrong.append(f"{method.upper()} {url} with a wrong kind of token: {status}")
        if "{" in path:
            cases.add()
            status = call(outsider, method, url)
            nothing = call(outsider, method, filled(path, things, missing=True) or url)
            if status != nothing or status < 300:
                wrong.append(f"{method.upper()} {url} as another's runner: {status} ({nothing})")
    for path, method in operations():
        if path.startswith("/api/v1/runner") or "{" in path:
            continue
        cases.add()
        if (status := call(egress_as_api, method, path)) != 401:
            wrong.append(f"{method.upper()} {path} with an egress credential: {status}")
    assert wrong == []


def test_a_renewed_runner_token_or_a_revoked_egress_token_opens_nothing(acme, things, cases):
    renew_runner_tokens()  # as every start of the control plane does: the old ones stop
    gone = APIClient()
    gone.credentials(HTTP_AUTHORIZATION=f"Runner {things['runner_token']}")
    cases.add()
    assert call(gone, "get", "/api/v1/runner/") == 401
    revoke_tokens(EgressToken.objects.filter(agent__organisation=acme))
    revoked = APIClient()
    revoked.credentials(HTTP_AUTHORIZATION=f"Token {things['credentials'].split(':', 1)[1]}")
    cases.add()
    assert call(revoked, "get", "/api/v1/agents/") == 401
