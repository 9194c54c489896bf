"""Requests and their approval: filing, merging, answering at once, deciding (scope, expiry,
permissions), what a decision produces, expiry of grants and of unattended requests, the
notification, and the API."""

from datetime import timedelta

import pytest
from django.core import mail
from django.core.exceptions import PermissionDenied, ValidationError
from django.utils import timezone

from agents.models import Agent
from agents.services import effective_allowlist
from allowlists.entries import parse_entry
from approvals import services
from approvals.models import Grant, Request, Scope, Status
from egress.models import Decision
from egress.services import issue_token
from organisations.models import Organisation, OwnRequests
from runs.services import queue_run
from tests.factories import AgentFactory, UserFactory, WorkplaceFactory
from workplaces.services import update_workplace

pytestmark = pytest.mark.django_db

TARGET = "registry.example.org"


@pytest.fixture
def workplace(acme):
    return WorkplaceFactory(organisation=acme, packages={"apt": ["git"]})


@pytest.fixture
def agent(acme, workplace):
    return AgentFactory(organisation=acme, workplace=workplace)


def allowed(agent: Agent, target: str = TARGET) -> bool:
    agent = Agent.objects.get(pk=agent.pk)
    return parse_entry(target) in effective_allowlist(agent)


# --- filing --------------------------------------------------------------------------------------


def test_an_egress_request_records_who_asked_why_and_from_which_run(agent, alice):
    run = queue_run(agent, "fetch the SDK")
    request = services.file_egress(agent, "Registry.Example.org.", reason="the SDK", run=run)
    assert (request.kind, request.target, request.status) == ("egress", f"{TARGET}:443", "pending")
    (asked,) = request.requesters.all()
    assert (asked.agent, asked.run, asked.reason, asked.filed_by) == (agent, run, "the SDK", None)
    assert request.workplace == agent.workplace


def test_duplicates_are_merged_with_every_requester_kept(acme, agent, workplace):
    first = services.file_egress(agent, TARGET, reason="one")
    again = services.file_egress(agent, f"{TARGET}:443", reason="two")
    assert again.pk == first.pk
    other = AgentFactory(organisation=acme, workplace=workplace)
    package = services.file_package(agent, "apt", "jq", reason="parse JSON")
    same = services.file_package(other, "apt", "jq", reason="me too")
    assert same.pk == package.pk  # one workplace, one package: one request
    assert [r.reason for r in package.requesters.all()] == ["parse JSON", "me too"]
    assert Request.objects.count() == 2
    assert len(mail.outbox) == 0  # no approver has an email address here


def test_something_already_allowed_is_answered_at_once(acme, agent):
    request = services.file_egress(agent, "api.anthropic.com", reason="the model")
    assert request.status == Status.APPROVED
    assert request.note == "already allowed (base)"
    assert request.decided_by is None and request.produced == {}
    present = services.file_package(agent, "apt", "git", reason="clone")
    assert present.status == Status.APPROVED and present.note.startswith("already in")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda a: services.file_egress(a, "*.example.org", reason="x"), "wildcard"),
        (lambda a: services.file_egress(a, "10.0.0.1", reason="x"), "IP"),
        (lambda a: services.file_egress(a, TARGET, reason="  "), "say why"),
        (lambda a: services.file_package(a, "cargo", "serde", reason="x"), "not an ecosystem"),
        (lambda a: services.file_package(a, "apt", "jq; rm -rf /", reason="x"), "Debian package"),
    ],
)
def test_bad_requests_are_refused_saying_what_is_wrong_and_nothing_is_kept(agent, call, message):
    with pytest.raises(ValidationError, match=message):
        call(agent)
    assert Request.objects.count() == 0


def test_a_package_needs_a_workplace(acme):
    lone = AgentFactory(organisation=acme)
    with pytest.raises(ValidationError, match="the agent has no workplace"):
        services.file_package(lone, "apt", "jq", reason="x")


# --- deciding ------------------------------------------------------------------------------------


def test_an_approved_route_is_a_new_agent_version_and_allowed_at_once(agent, april):
    request = services.file_egress(agent, TARGET, reason="SDK")
    before = agent.version
    decided = services.approve(request, by=april, note="vendor SDK, fine")
    agent.refresh_from_db()
    assert (decided.status, decided.decided_by, decided.note) == (
        "approved",
        april,
        "vendor SDK, fine",
    )
    assert decided.produced == {"agent_versions": {str(agent.pk): before + 1}}
    assert allowed(agent)
    made = agent.versions.get(number=agent.version)
    assert made.created_by == april
    assert made.reason == f"request #{request.pk} approved: egress {request.target}"  # history


def test_a_route_for_the_workplace_goes_to_each_of_its_agents(acme, agent, workplace, april):
    sibling = AgentFactory(organisation=acme, workplace=workplace)
    outsider = AgentFactory(organisation=acme)
    request = services.file_egress(agent, TARGET, reason="SDK")
    decided = services.approve(request, by=april, note="all of them", scope=Scope.WORKPLACE)
    assert set(decided.produced["agent_versions"]) == {str(agent.pk), str(sibling.pk)}
    assert allowed(agent) and allowed(sibling) and not allowed(outsider)


def test_a_route_for_the_organisation_goes_to_its_base_list(acme, agent, april):
    request = services.file_egress(agent, TARGET, reason="SDK")
    services.approve(request, by=april, note="everyone", scope=Scope.ORGANISATION)
    assert TARGET in Organisation.objects.get(pk=acme.pk).base_allowlist
    history = Organisation.objects.get(pk=acme.pk).history.latest()
    assert (
        history.history_change_reason == f"request #{request.pk} approved: egress {request.target}"
    )
    assert allowed(AgentFactory(organisation=acme))


def test_a_granted_route_goes_again_when_it_expires(agent, april):
    request = services.file_egress(agent, TARGET, reason="once")
    soon = timezone.now() + timedelta(minutes=5)
    services.approve(request, by=april, note="for today", expires_at=soon)
    version = Agent.objects.get(pk=agent.pk).version
    assert services.expire_grants(timezone.now()) == 0 and allowed(agent)
    assert services.expire_grants(soon + timedelta(seconds=1)) == 1
    assert not allowed(agent)
    grant = Grant.objects.get()
    assert grant.removed_at is not None and grant.removed_version == version + 1
    removed = agent.versions.get(number=version + 1)
    assert removed.reason == f"grant of {grant.entry} (request #{request.pk}) expired"
    assert services.expire_grants(soon + timedelta(hours=1)) == 0  # once


def test_an_approved_package_is_a_new_workplace_version(agent, workplace, april):
    request = services.file_package(agent, "apt", "jq", reason="parse JSON")
    decided = services.approve(request, by=april, note="ok")
    workplace.refresh_from_db()
    assert workplace.packages == {"apt": ["git", "jq"]}
    assert decided.produced == {"workplace_version": workplace.version} and workplace.version == 2
    assert (
        workplace.versions.get(number=2).reason == f"request #{request.pk} approved: package apt jq"
    )
    assert queue_run(agent, "next").workplace_version.number == 2  # the next run has it


def test_a_rejection_needs_a_note_and_changes_nothing(agent, april):
    request = services.file_egress(agent, TARGET, reason="x")
    with pytest.raises(ValidationError, match="a decision needs a note"):
        services.reject(request, by=april, note=" ")
    decided = services.reject(request, by=april, note="use the mirror")
    assert (decided.status, decided.note) == ("rejected", "use the mirror")
    assert not allowed(agent)
    with pytest.raises(ValidationError, match="it was rejected already"):
        services.approve(request, by=april, note="changed my mind")


def test_viewers_and_whoever_filed_it_cannot_decide(agent, alice, april, vera, gary):
    request = services.file_egress(agent, TARGET, reason="x", by=alice)
    for who, why in (
        (vera, "only approvers and admins"),
        (gary, "only approvers and admins"),  # another organisation's admin
        (alice, "you filed this request on the agent's behalf: somebody else decides it .april"),
    ):
        with pytest.raises(PermissionDenied, match=why):
            services.approve(request, by=who, note="mine")
    assert Request.objects.get(pk=request.pk).status == Status.PENDING
    assert not services.approve(request, by=april, note="four eyes").decided_by_filer


def test_the_only_approver_decides_their_own_filing_and_it_is_recorded(acme, agent, alice, vera):
    # A one-person installation: alice is acme's only approver or admin (vera only reads).
    request = services.file_egress(agent, TARGET, reason="the SDK", by=alice)
    assert services.can_decide(alice, request) == ""
    decided = services.approve(request, by=alice, note="nobody else can")
    assert (decided.status, decided.decided_by, decided.decided_by_filer) == (
        Status.APPROVED, alice, True,
    )  # fmt: skip
    assert allowed(agent)


def test_an_organisation_can_insist_on_four_eyes_even_with_one_approver(acme, agent, alice):
    Organisation.objects.filter(pk=acme.pk).update(own_requests=OwnRequests.NEVER)
    request = services.file_egress(agent, TARGET, reason="x", by=alice)
    with pytest.raises(PermissionDenied, match="the organisation's four-eyes setting"):
        services.reject(request, by=alice, note="mine")
    assert Request.objects.get(pk=request.pk).status == Status.PENDING


def test_the_platform_team_counts_as_somebody_else(agent, alice, root):
    request = services.file_egress(agent, TARGET, reason="x", by=alice)
    assert "root may" in services.can_decide(alice, request)
    root.is_active = False
    root.save()
    assert services.can_decide(alice, request) == ""  # an inactive account decides nothing


def test_a_request_keeps_the_workplace_version_it_was_filed_against(agent, workplace, april):
    before = workplace.version
    request = services.file_package(agent, "apt", "curl", reason="fetch")
    update_workplace(workplace, by=april, packages={"apt": ["git", "jq"]})
    request.refresh_from_db()
    assert request.workplace_version == before
    assert Request.objects.get(pk=request.pk).workplace.version == before + 1


def test_unattended_requests_expire_as_rejected_after_the_organisations_time(acme, agent):
    request = services.file_egress(agent, TARGET, reason="x")
    assert services.expire_unattended(timezone.now() + timedelta(days=30)) == 0  # no time set
    Organisation.objects.filter(pk=acme.pk).update(request_expiry_minutes=30)
    assert services.expire_unattended(timezone.now() + timedelta(minutes=29)) == 0
    assert services.expire_unattended(timezone.now() + timedelta(minutes=31)) == 1
    request.refresh_from_db()
    assert (request.status, request.expired) == ("rejected", True)
    assert request.note == "expired: nobody decided it within 30 minutes"


def test_approvers_are_emailed_of_a_new_request(acme, agent, django_capture_on_commit_callbacks):
    from organisations.models import Membership, Role

    approver = UserFactory(username="ann", email="ann@example.test")
    Membership.objects.create(organisation=acme, user=approver, role=Role.APPROVER)
    viewer = UserFactory(username="val", email="val@example.test")
    Membership.objects.create(organisation=acme, user=viewer, role=Role.VIEWER)
    with django_capture_on_commit_callbacks(execute=True):
        request = services.file_egress(agent, TARGET, reason="the SDK")
        services.file_egress(agent, TARGET, reason="again")  # merged: no second mail
    (sent,) = mail.outbox
    assert sent.to == ["ann@example.test"]
    assert sent.subject == f"covey: {agent} asks for {TARGET}:443"
    assert "the SDK" in sent.body and f"/admin/approvals/request/{request.pk}/decide/" in sent.body


# --- the API -------------------------------------------------------------------------------------


def test_the_api_files_lists_and_decides(api, alice, april, vera, agent):
    filed = api(alice).post(
        "/api/v1/requests/",
        {"agent": agent.pk, "kind": "egress", "target": TARGET, "reason": "the SDK"},
        format="json",
    )
    assert filed.status_code == 201, filed.content
    body = filed.json()
    assert (body["status"], body["requesters"][0]["filed_by"]) == ("pending", "alice")
    url = f"/api/v1/requests/{body['id']}/"
    assert api(vera).get(url).status_code == 200
    assert api(vera).post(f"{url}approve/", {"note": "x"}, format="json").status_code == 403
    refused = api(alice).post(f"{url}approve/", {"note": "mine"}, format="json")
    assert refused.status_code == 403 and "somebody else decides" in refused.json()["detail"]
    assert api(april).post(f"{url}approve/", {}, format="json").status_code == 400  # no note
    approved = (
        api(april).post(f"{url}approve/", {"note": "fine", "scope": "agent"}, format="json").json()
    )
    assert (approved["status"], approved["decided_by"]) == ("approved", "april")
    assert approved["grants"][0]["entry"] == TARGET
    pending = api(vera).get("/api/v1/package-requests/?status=pending").json()
    assert pending["count"] == 0
    again = api(april).post(f"{url}reject/", {"note": "no"}, format="json")
    assert again.status_code == 409 and again.json() == {"detail": "it was approved already"}


def test_only_admins_file_and_other_organisations_see_nothing(api, april, gary, agent):
    filing = {"agent": agent.pk, "kind": "package", "ecosystem": "apt", "package": "jq",
              "reason": "x"}  # fmt: skip
    assert api(april).post("/api/v1/requests/", filing, format="json").status_code == 403
    request = services.file_package(agent, "apt", "jq", reason="x")
    assert api(gary).get(f"/api/v1/requests/{request.pk}/").status_code == 404
    assert api(gary).post(f"/api/v1/requests/{request.pk}/reject/", {"note": "no"},
                          format="json").status_code == 404  # fmt: skip
    assert api(gary).post("/api/v1/requests/", filing, format="json").status_code == 400


def test_the_admins_decision_page_refuses_a_decision_without_a_note(client, root, agent):
    request = services.file_egress(agent, TARGET, reason="x")
    client.force_login(root)
    url = f"/admin/approvals/request/{request.pk}/decide/"
    answer = client.post(url, {"decision": "approve", "note": ""})
    assert answer.status_code == 200 and "This field is required" in answer.content.decode()
    assert Request.objects.get(pk=request.pk).status == Status.PENDING
    assert client.post(url, {"decision": "approve", "note": "ok"}).status_code == 302
    again = client.get(url).content.decode()
    assert "You cannot decide this request: it was approved already." in again


def test_an_expiring_grant_removes_only_what_it_added(agent, april):
    from agents.services import update_agent

    update_agent(agent, allowlist=[TARGET])  # a person allowed it already
    soon = timezone.now() + timedelta(minutes=5)
    request = services.file_egress(agent, "other.example.org", reason="x")
    services.approve(request, by=april, note="today", expires_at=soon)
    Grant.objects.create(  # as if granted again for the entry a person had added
        request=request, entry=TARGET, agent=agent, organisation=agent.organisation,
        expires_at=soon, added=False,
    )  # fmt: skip
    assert services.expire_grants(soon + timedelta(seconds=1)) == 2
    assert allowed(agent) and not allowed(agent, "other.example.org")


def test_package_versions_merge_only_when_they_are_the_same(agent, workplace, april):
    first = services.file_package(agent, "apt", "jq=1.6", reason="x")
    assert services.file_package(agent, "apt", "jq=1.7", reason="y").pk != first.pk
    assert services.file_package(agent, "apt", "jq=1.6", reason="z").pk == first.pk
    services.approve(first, by=april, note="ok")
    workplace.refresh_from_db()
    assert workplace.packages == {"apt": ["git", "jq=1.6"]}
    present = services.file_package(agent, "apt", "jq", reason="any jq will do")
    assert present.status == Status.APPROVED and present.note.endswith("(jq=1.6)")
    other = Request.objects.get(package="jq=1.7")
    decided = services.approve(other, by=april, note="newer")
    assert decided.produced["replaced"] == ["jq=1.6"]


def test_pip_and_npm_requests_use_their_ecosystems_names(agent, workplace, april):
    # Written as the agent wrote it, merged and compared by the package's canonical name.
    first = services.file_package(agent, "pip", "PyYAML==6.0.1", reason="x")
    assert first.package == "pyyaml==6.0.1"
    assert services.file_package(agent, "pip", "pyyaml==6.0.1", reason="y").pk == first.pk
    services.approve(first, by=april, note="ok")
    newer = services.file_package(agent, "pip", "pyyaml>=6.0.2", reason="newer")
    assert services.approve(newer, by=april, note="ok").produced["replaced"] == ["pyyaml==6.0.1"]
    present = services.file_package(agent, "pip", "PyYAML", reason="any")
    assert present.status == Status.APPROVED and present.note.endswith("(pyyaml>=6.0.2)")
    scoped = services.file_package(agent, "npm", "@types/node@^20", reason="types")
    services.approve(scoped, by=april, note="ok")
    workplace.refresh_from_db()
    assert workplace.packages == {
        "apt": ["git"],
        "pip": ["pyyaml>=6.0.2"],
        "npm": ["@types/node@^20"],
    }
    assert services.file_package(agent, "npm", "@types/node", reason="x").status == Status.APPROVED
    with pytest.raises(ValidationError, match="names a URL"):
        services.file_package(agent, "pip", "x @ https://evil.example/x.whl", reason="x")
    with pytest.raises(ValidationError, match="'cargo' is not an ecosystem"):
        services.file_package(agent, "cargo", "serde", reason="x")


def test_an_agent_cannot_flood_its_approvers(agent, monkeypatch):
    monkeypatch.setattr(services, "MAX_PENDING_PER_AGENT", 2)
    services.file_egress(agent, "a.example.org", reason="x")
    services.file_egress(agent, "b.example.org", reason="x")
    services.file_egress(agent, "a.example.org", reason="again")  # merged: fine
    with pytest.raises(ValidationError, match="has 2 requests waiting for a decision already"):
        services.file_egress(agent, "c.example.org", reason="x")


def test_the_desk_itself_is_no_route_and_a_disabled_agent_files_nothing(agent):
    from agents.services import update_agent
    from egress.policy import hash_token
    from egress.services import issue_token

    with pytest.raises(ValidationError, match="is the proxy's own"):
        services.file_egress(agent, "requests.covey.invalid:80", reason="x")
    _, credentials = issue_token(agent)
    token = hash_token(credentials.split(":", 1)[1])
    filing = {"kind": "egress", "target": TARGET, "reason": "x"}
    assert services.desk_file(token, filing)[0] == 201
    update_agent(agent, enabled=False)
    code, body = services.desk_file(token, filing)
    assert code == 403 and "is disabled" in body["detail"]


def test_a_mail_server_that_fails_does_not_fail_the_filing(
    acme, agent, settings, django_capture_on_commit_callbacks, caplog
):
    from organisations.models import Membership, Role

    settings.EMAIL_BACKEND = "tests.approvals.test_requests.BrokenMail"
    approver = UserFactory(username="ann", email="ann@example.test")
    Membership.objects.create(organisation=acme, user=approver, role=Role.APPROVER)
    with django_capture_on_commit_callbacks(execute=True):
        request = services.file_egress(agent, TARGET, reason="x")
    assert Request.objects.filter(pk=request.pk).exists()
    assert f"approvers could not be told of request {request.pk}" in caplog.text


class BrokenMail:
    def __init__(self, *args, **kwargs):
        pass

    def send_messages(self, messages):
        raise ConnectionRefusedError("the mail server is down")


def test_only_a_recent_refusal_is_taken_for_what_prompted_a_sandboxs_request(agent):
    """A request from a sandbox is linked to the agent's latest refusal of that route within
    REFUSAL_WINDOW: one older than that prompted nothing the agent asks now."""
    token, _ = issue_token(agent)
    now = timezone.now()

    def refused(host: str, ago: timedelta) -> Decision:
        return Decision.objects.create(
            agent=agent, kind="connect", host=host, port=443, allowed=False,
            reason="not-on-allowlist", proxy="edge-1", decided_at=now - ago,
        )  # fmt: skip

    recent = refused("recent.example.org", services.REFUSAL_WINDOW - timedelta(minutes=1))
    refused("stale.example.org", services.REFUSAL_WINDOW + timedelta(minutes=1))
    for host, prompted in [("recent.example.org", recent), ("stale.example.org", None)]:
        filed = {"kind": "egress", "target": host, "reason": "the SDK"}
        request = services.file_from_sandbox(agent.organisation, token.sha256, filed)
        assert request.requesters.get().refusal == prompted, host


def test_which_of_a_page_of_requests_a_person_decides_agrees_with_can_decide(
    acme, globex, agent, alice, april, vera, gary, root
):
    """services.decidable answers for a page in a few queries what can_decide says row by
    row: for a viewer, an approver, a filer with and without somebody else, four eyes set
    to never, another organisation's admin and the platform team."""
    theirs = AgentFactory(organisation=globex, name="Spy")
    requests = [
        services.file_egress(agent, "a.example.test", reason="x"),
        services.file_egress(agent, "b.example.test", reason="x", by=alice),
        services.file_egress(agent, "c.example.test", reason="x", by=april),
        services.file_egress(theirs, "d.example.test", reason="x", by=gary),
    ]
    services.reject(services.file_egress(agent, "e.example.test", reason="x"), by=april, note="n")
    requests.append(Request.objects.get(target="e.example.test:443"))

    def agrees() -> None:
        for user in (alice, april, vera, gary, root):
            fresh = list(Request.objects.filter(pk__in=[r.pk for r in requests]))
            expected = {r.pk for r in fresh if not services.can_decide(user, r)}
            assert services.decidable(user, fresh) == expected, user

    agrees()
    root.is_active = False  # gary is then globex's only decider of his own filing
    root.save()
    agrees()
    Organisation.objects.filter(pk=globex.pk).update(own_requests=OwnRequests.NEVER)
    agrees()
