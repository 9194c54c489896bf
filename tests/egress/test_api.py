"""Egress tokens and the decision log through the API, the commands and the admin."""

import time
from datetime import timedelta
from io import StringIO

import pytest
import time_machine
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from egress.models import Decision, EgressToken, ProxySession
from egress.policy import hash_token
from egress.services import issue_token, prune_decisions
from tests.factories import AgentFactory, record_events
from tests.factories import decision_event as event

pytestmark = pytest.mark.django_db


class TestTokenCommand:
    def test_it_prints_exactly_one_line_username_colon_token(self, acme):
        agent = AgentFactory(organisation=acme, name="builder")
        out = StringIO()
        call_command("egress_token", "acme/builder", stdout=out)
        lines = out.getvalue().splitlines()
        assert len(lines) == 1
        username, _, secret = lines[0].partition(":")
        assert username == "acme.builder"
        token = EgressToken.objects.get(agent=agent)
        assert token.sha256 == hash_token(secret)  # only the hash is kept
        assert secret not in str(EgressToken.objects.values_list())

    def test_it_finds_agents_by_id_and_by_unique_slug(self, acme):
        agent = AgentFactory(organisation=acme, name="builder")
        for reference in (str(agent.pk), "builder"):
            out = StringIO()
            call_command("egress_token", reference, "--ttl", "60", stdout=out)
            assert out.getvalue().startswith("acme.builder:")
        assert EgressToken.objects.filter(agent=agent).count() == 2

    def test_an_unknown_or_ambiguous_agent_is_a_clear_error(self, acme, globex):
        AgentFactory(organisation=acme, name="builder")
        AgentFactory(organisation=globex, name="builder")
        with pytest.raises(CommandError, match="several agents"):
            call_command("egress_token", "builder")
        with pytest.raises(CommandError, match="no agent"):
            call_command("egress_token", "nope")
        with pytest.raises(CommandError, match="positive"):
            call_command("egress_token", "acme/builder", "--ttl", "0")

    @override_settings(COVEY_EGRESS_TOKEN_TTL=7200)
    def test_tokens_live_as_long_as_the_setting_says(self, acme):
        agent = AgentFactory(organisation=acme)
        with time_machine.travel("2026-01-01 12:00:00+00:00", tick=False):
            token, _ = issue_token(agent)
        assert token.expires_at.isoformat() == "2026-01-01T14:00:00+00:00"


class TestTokenApi:
    def test_an_admin_creates_a_token_and_sees_the_secret_once(self, api, alice, acme):
        agent = AgentFactory(organisation=acme)
        response = api(alice).post(
            "/api/v1/egress-tokens/", {"agent": agent.pk, "ttl": 600}, format="json"
        )
        assert response.status_code == 201, response.content
        credentials = response.json()["credentials"]
        assert credentials.startswith(f"acme.{agent.slug}:")
        listed = api(alice).get("/api/v1/egress-tokens/").json()["results"]
        assert listed[0]["credentials"] is None
        assert listed[0]["prefix"] == credentials.split(":")[1][:8]
        assert listed[0]["live"] is True

    def test_revoking_is_for_admins(self, api, alice, vera, acme):
        agent = AgentFactory(organisation=acme)
        token, _ = issue_token(agent)
        url = f"/api/v1/egress-tokens/{token.pk}/revoke/"
        assert api(vera).post(url).status_code == 403
        response = api(alice).post(url)
        assert response.status_code == 200
        assert response.json()["revoked_at"] is not None
        assert response.json()["live"] is False
        assert api(alice).get(f"/api/v1/egress-tokens/{token.pk}/").json()["live"] is False
        token.refresh_from_db()
        assert not token.is_live

    def test_viewers_cannot_mint_tokens_and_strangers_cannot_see_them(self, api, vera, gary, acme):
        agent = AgentFactory(organisation=acme)
        issue_token(agent)
        response = api(vera).post("/api/v1/egress-tokens/", {"agent": agent.pk}, format="json")
        assert response.status_code == 403
        assert api(gary).get("/api/v1/egress-tokens/").json()["count"] == 0


class TestDecisionLog:
    def test_people_see_their_organisations_decisions_only(self, api, alice, gary, acme, globex):
        ours, theirs = AgentFactory(organisation=acme), AgentFactory(organisation=globex)
        record_events([event(ours), event(theirs, allowed=False, reason="not-on-allowlist")])
        results = api(alice).get("/api/v1/egress-decisions/").json()["results"]
        assert [r["agent"] for r in results] == [ours.pk]
        denied = api(gary).get("/api/v1/egress-decisions/?allowed=false").json()["results"]
        assert [r["reason"] for r in denied] == ["not-on-allowlist"]

    def test_it_filters_by_reason_host_and_time(self, api, alice, acme):
        agent = AgentFactory(organisation=acme)
        old = time.time() - 3600
        record_events(
            [
                event(agent, host="a.example"),
                event(agent, host="b.example", allowed=False, reason="ip-literal"),
                event(agent, host="c.example", at=old),
            ]
        )
        client = api(alice)
        hosts = lambda query: sorted(  # noqa: E731
            r["host"] for r in client.get(f"/api/v1/egress-decisions/?{query}").json()["results"]
        )
        assert hosts("reason=ip-literal") == ["b.example"]
        assert hosts("host__endswith=a.example") == ["a.example"]
        since = (timezone.now() - timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
        assert hosts(f"decided_at__gte={since}") == ["a.example", "b.example"]

    def test_tunnel_closes_fill_in_the_byte_counts(self, acme):
        agent = AgentFactory(organisation=acme)
        opened = event(agent)
        record_events([opened])
        record_events(
            [
                {
                    "event": "close",
                    "id": opened["id"],
                    "bytes_up": 10,
                    "bytes_down": 2000,
                    "at": time.time(),
                }
            ]
        )
        row = Decision.objects.get()
        assert (row.bytes_up, row.bytes_down) == (10, 2000)
        assert row.closed_at is not None

    def test_a_runner_cannot_write_into_another_organisations_log(self, acme, globex):
        theirs = AgentFactory(organisation=globex)
        record_events([event(theirs)], organisation_id=acme.pk)
        assert Decision.objects.get().agent is None

    @override_settings(COVEY_EGRESS_DECISION_RETENTION_DAYS=30)
    def test_old_decisions_are_pruned(self, acme):
        agent = AgentFactory(organisation=acme)
        now = time.time()
        record_events([event(agent, at=now - 31 * 86400), event(agent, at=now - 29 * 86400)])
        assert prune_decisions() == 1
        assert Decision.objects.count() == 1

    def test_the_admin_lists_decisions_read_only(self, operator_client, acme):
        record_events([event(AgentFactory(organisation=acme))])
        row = Decision.objects.get()
        url = reverse("admin:egress_decision_changelist")
        assert operator_client.get(url, {"allowed__exact": "1"}).status_code == 200
        page = operator_client.get(reverse("admin:egress_decision_change", args=[row.pk]))
        assert page.status_code == 200
        assert b'name="_save"' not in page.content
        assert (
            operator_client.post(
                reverse("admin:egress_decision_delete", args=[row.pk]), {"post": "yes"}
            ).status_code
            == 403
        )
        assert Decision.objects.count() == 1


def test_the_admin_revokes_tokens_and_says_how_many(operator_client, acme):
    agent = AgentFactory(organisation=acme)
    tokens = [issue_token(agent)[0] for _ in range(3)]
    response = operator_client.post(
        reverse("admin:egress_egresstoken_changelist"),
        {"action": "revoke", "_selected_action": [t.pk for t in tokens[:2]]},
        follow=True,
    )
    assert b"2 token(s) revoked" in response.content
    assert EgressToken.objects.live().count() == 1


class TestDecisionBatches:
    def test_a_decision_and_its_close_in_one_batch_make_one_complete_row(self, acme):
        agent = AgentFactory(organisation=acme)
        opened = event(agent)
        closed = {"event": "close", "id": opened["id"], "bytes_up": 7, "bytes_down": 9, "at": 1.0}
        assert record_events([opened, closed]) == 2
        row = Decision.objects.get()
        assert (row.bytes_up, row.bytes_down, row.closed_at.timestamp()) == (7, 9, 1.0)

    def test_a_batch_stores_each_field_as_the_model_reads_it(self, acme):
        agent = AgentFactory(organisation=acme)
        opened = event(agent, address="2001:DB8:0:0::1", at=1.5, username="bob\x00")
        stranger = event(None, allowed=False, reason="proxy-auth-required", address=None)
        assert record_events([opened, stranger]) == 2
        row = Decision.objects.get(agent=agent)
        assert str(row.id) == opened["id"] and row.address == "2001:db8::1"
        assert (row.decided_at.timestamp(), row.username, row.closed_at) == (1.5, "bob", None)
        other = Decision.objects.get(agent=None)
        assert (other.allowed, other.reason, other.address) == (False, "proxy-auth-required", None)

    def test_a_batch_sent_twice_is_stored_once_and_keeps_its_close(self, acme):
        agent = AgentFactory(organisation=acme)
        opened = event(agent)
        closed = {"event": "close", "id": opened["id"], "bytes_up": 7, "bytes_down": 9, "at": 1.0}
        record_events([opened])
        record_events([opened, closed])  # the proxy never heard that the first one landed
        row = Decision.objects.get()
        assert (row.bytes_up, row.bytes_down) == (7, 9)

    def test_a_runner_cannot_close_another_organisations_decision(self, acme, globex):
        theirs = event(AgentFactory(organisation=globex))
        record_events([theirs])
        closed = {"event": "close", "id": theirs["id"], "bytes_up": 1, "bytes_down": 1, "at": 1.0}
        record_events([theirs, closed], organisation_id=acme.pk)
        assert Decision.objects.get().closed_at is None


class TestProxySessions:
    """What the log admits it lacks: egress.models.ProxySession, from the proxies' numbers."""

    @staticmethod
    def numbered(boot: str, seq: int, agent) -> dict:
        return event(agent, boot=boot, seq=seq)

    @staticmethod
    def mark(kind: str, boot: str, **fields) -> dict:
        return {"event": kind, "boot": boot, "at": time.time(), **fields}

    def test_a_clean_life_is_whole(self, acme):
        agent = AgentFactory(organisation=acme)
        record_events([self.mark("start", "a1")], proxy="p")
        batch = [self.numbered("a1", n, agent) for n in (1, 2, 3)]
        record_events(batch, proxy="p")
        record_events(batch, proxy="p")  # sent again: counted once
        record_events([self.mark("stop", "a1", seq=3)], proxy="p")
        session = ProxySession.objects.get()
        assert (session.end, session.made, session.recorded, session.gap) == ("stopped", 3, 3, "")

    def test_numbers_it_never_sent_are_admitted(self, acme):
        agent = AgentFactory(organisation=acme)
        record_events([self.mark("start", "b1"), self.numbered("b1", 1, agent)], proxy="p")
        record_events([self.numbered("b1", 4, agent)], proxy="p")  # 2 and 3 were dropped
        record_events([self.mark("stop", "b1", seq=6)], proxy="p")  # 5 and 6 never came
        session = ProxySession.objects.get()
        assert (session.made, session.recorded, session.missing) == (6, 2, 4)
        assert session.gap == "4 of its 6 decisions are not in the log"

    def test_a_life_without_a_stop_is_admitted_when_the_proxy_starts_again(self, acme, globex):
        agent = AgentFactory(organisation=acme)
        record_events([self.mark("start", "c1"), self.numbered("c1", 1, agent)], proxy="p")
        record_events([self.mark("start", "g1")], proxy="p", organisation_id=globex.pk)
        record_events([self.mark("start", "c2")], proxy="p")
        killed, others = ProxySession.objects.get(boot="c1"), ProxySession.objects.get(boot="g1")
        assert killed.end == "lost" and killed.ended_at is not None
        assert killed.gap == (
            "it ended without a clean stop: any decisions after no. 1 are unknown"
        )
        assert others.end == "running"  # another organisation's proxy of the same name

    def test_a_runner_cannot_count_for_another_proxys_life(self, acme, globex):
        agent = AgentFactory(organisation=acme)
        record_events([self.mark("start", "d1")], proxy="edge", organisation_id=acme.pk)
        record_events(
            [self.numbered("d1", 9, agent), self.mark("stop", "d1", seq=9)],
            proxy="edge",
            organisation_id=globex.pk,
        )
        session = ProxySession.objects.get()
        assert (session.end, session.made, session.recorded) == ("running", 0, 0)

    @pytest.mark.parametrize("boot", ["", "x" * 33, "../a", 7.5])
    def test_a_malformed_boot_is_refused_and_nothing_is_written(self, acme, boot):
        agent = AgentFactory(organisation=acme)
        with pytest.raises(ValueError, match="boot"):
            record_events([self.numbered(str(boot), 1, agent)], proxy="p")
        assert not Decision.objects.exists() and not ProxySession.objects.exists()

    @pytest.mark.parametrize(
        "fields",
        [
            {"at": 1e20},
            {"at": float("nan")},
            {"seq": 2**63},
            {"seq": -1},
            {"seq": float("inf")},  # JSON's 1e400
            {"port": 70000},
            {"port": float("inf")},
        ],
    )
    def test_numbers_out_of_bounds_are_refused_and_nothing_is_written(self, acme, fields):
        agent = AgentFactory(organisation=acme)
        with pytest.raises(ValueError):
            record_events([{**self.numbered("f1", 1, agent), **fields}], proxy="p")
        assert not Decision.objects.exists() and not ProxySession.objects.exists()

    def test_a_nul_a_sandbox_put_in_its_user_name_is_not_kept_and_fails_nothing(self, acme):
        agent = AgentFactory(organisation=acme)
        record_events([{**self.numbered("n1", 1, agent), "username": "ev\x00il"}], proxy="p")
        assert Decision.objects.get().username == "evil"

    def test_the_decision_log_says_when_it_is_not_whole(self, operator_client, acme):
        agent = AgentFactory(organisation=acme)
        record_events([self.mark("start", "e1"), self.numbered("e1", 2, agent)], proxy="p")
        page = operator_client.get(reverse("admin:egress_decision_changelist"))
        assert b"This log is not whole" in page.content
        listed = operator_client.get(
            reverse("admin:egress_proxysession_changelist"), {"gap": "yes"}
        )
        assert b"1 of its 2 decisions are not in the log" in listed.content
        record_events([self.numbered("e1", 1, agent)], proxy="p")
        page = operator_client.get(reverse("admin:egress_decision_changelist"))
        assert b"This log is not whole" not in page.content
