"""The pure decision engine: identity, switches, allowlist match and address vetting."""

import base64
import ipaddress

import pytest

from allowlists.entries import Entry
from egress.policy import (
    Attempt,
    Code,
    Decision,
    Policy,
    check_addresses,
    check_agent,
    check_client_hello,
    check_request,
    hash_token,
    is_public,
    parse_basic,
    parse_networks,
    status_of,
)
from egress.protocol import PolicyDelta, PolicySnapshot

NOW = 1_000_000.0


def basic(username, secret):
    return "Basic " + base64.b64encode(f"{username}:{secret}".encode()).decode()


LISTS = {
    "base:acme": "api.anthropic.com\ngit.example",
    "template:debian-ubuntu": "deb.example:80",
    "template:unused": "unused.example",
}


def snapshot(**agent_overrides):
    agent = {
        "id": 7,
        "username": "acme.builder",
        "organisation": "acme",
        "enabled": True,
        "budget_exhausted": False,
        "lists": ["base:acme", "template:debian-ubuntu"],
        "own": "git.example\ngit.example:8443",  # an entry per line
        "tokens": [{"sha256": hash_token("s3cret"), "expires_at": NOW + 60}],
    }
    agent.update(agent_overrides)
    return {"generation": "g1", "agents": [agent], "lists": LISTS}


def from_json(data: dict) -> Policy:
    """The policy of a snapshot as the control plane serves it (JSON), parsed as a proxy does."""
    return Policy.from_snapshot(PolicySnapshot.from_json(data))


@pytest.fixture
def policy():
    return from_json(snapshot())


def identified(policy, header, now=NOW):
    """The agent check_request identifies from a credential (None: a 407)."""
    decision = check_request(policy, Attempt(header, "api.anthropic.com", 443), now)
    assert (decision.agent is None) == (decision.code is Code.PROXY_AUTH)
    return decision.agent


def by_name(agent, host, port, *, plain_http, at_capacity):
    """check_agent: steps 2 and 3 for an identified agent."""
    return check_agent(agent, Attempt(None, host, port, plain_http), full=lambda _: at_capacity)


def by_address(host, port, addresses, allowed=()):
    """check_addresses after an allow of host:port: the decision and the address it dials."""
    decision = check_addresses(Decision(Code.ALLOWED, host, port), addresses, allowed)
    return decision, decision.address


@pytest.fixture
def agent(policy):
    return identified(policy, basic("acme.builder", "s3cret"))


class TestIdentity:
    def test_a_valid_credential_identifies_the_agent(self, agent):
        assert agent.id == 7

    @pytest.mark.parametrize(
        "header",
        [
            None,
            "",
            "Basic",
            "Bearer s3cret",
            "Basic not-base64!!",
            "Basic " + base64.b64encode(b"no-colon").decode(),
            basic("acme.builder", "wrong"),
            basic("acme.other", "s3cret"),  # the right token for another name
            basic("", "s3cret"),
            "Basic " + base64.b64encode(b"acme.builder:\xff").decode(),
        ],
    )
    def test_anything_else_identifies_nobody(self, policy, header):
        assert identified(policy, header, NOW) is None

    def test_an_expired_token_identifies_nobody(self, policy):
        assert identified(policy, basic("acme.builder", "s3cret"), NOW + 60) is None

    def test_the_scheme_is_case_insensitive(self, policy):
        header = basic("acme.builder", "s3cret").replace("Basic", "basic")
        assert identified(policy, header, NOW) is not None

    def test_a_token_may_contain_colons(self):
        assert parse_basic(basic("a", "b:c")) == ("a", "b:c")


class TestDecision:
    @pytest.mark.parametrize(
        ("host", "port", "plain", "code"),
        [
            ("api.anthropic.com", 443, False, Code.ALLOWED),
            ("API.Anthropic.com.", 443, False, Code.ALLOWED),
            ("git.example", 8443, False, Code.ALLOWED),
            ("deb.example", 80, True, Code.ALLOWED),
            ("deb.example", 80, False, Code.ALLOWED),  # a CONNECT to a listed :80 entry
            ("git.example", 22, False, Code.PORT_NOT_ALLOWED),
            ("api.anthropic.com", 80, True, Code.PORT_NOT_ALLOWED),
            ("git.example", 443, True, Code.PORT_NOT_ALLOWED),  # plain HTTP only to port 80
            ("deb.example", 443, False, Code.PORT_NOT_ALLOWED),
            ("evilgit.example", 443, False, Code.NOT_ON_ALLOWLIST),
            ("git.example.evil.net", 443, False, Code.NOT_ON_ALLOWLIST),
            ("sub.git.example", 443, False, Code.NOT_ON_ALLOWLIST),
            ("xn--gt-zia.example", 443, False, Code.NOT_ON_ALLOWLIST),  # a look-alike
            ("127.0.0.1", 443, False, Code.IP_LITERAL),
            ("2130706433", 443, False, Code.IP_LITERAL),
            ("0x7f.1", 443, False, Code.IP_LITERAL),
            ("::1", 443, False, Code.IP_LITERAL),
            ("[::ffff:127.0.0.1]", 443, False, Code.IP_LITERAL),
            ("bad host", 443, False, Code.BAD_REQUEST),
            ("*.example", 443, False, Code.BAD_REQUEST),
            ("git.example", 0, False, Code.BAD_REQUEST),
        ],
    )
    def test_targets(self, policy, agent, host, port, plain, code):
        assert by_name(agent, host, port, plain_http=plain, at_capacity=False).code == code

    def test_an_allow_says_where_the_entry_comes_from(self, policy, agent):
        decision = by_name(agent, "deb.example", 80, plain_http=True, at_capacity=False)
        assert decision.sources == ("template:debian-ubuntu",)

    def test_switches_come_before_the_target_in_the_order_of_the_design(self):
        disabled = from_json(snapshot(enabled=False, budget_exhausted=True))
        agent = disabled.agents[7]
        decision = by_name(agent, "127.0.0.1", 443, plain_http=False, at_capacity=True)
        assert decision.code is Code.AGENT_DISABLED
        broke = from_json(snapshot(budget_exhausted=True))
        decision = by_name(broke.agents[7], "x", 443, plain_http=False, at_capacity=True)
        assert decision.code is Code.BUDGET_EXHAUSTED
        assert status_of(decision.code) == 402  # the model gateway's answer too

    def test_a_full_proxy_refuses_before_looking_at_the_target(self, policy, agent):
        decision = by_name(agent, "127.0.0.1", 443, plain_http=False, at_capacity=True)
        assert decision.code is Code.CAPACITY

    @pytest.mark.parametrize(
        "bad",
        [
            {},
            {"generation": "g", "agents": [{"id": 1}]},
            {"generation": "g", "agents": "nope"},
            snapshot(own=["git.example"]),
            {**snapshot(), "lists": {"base:acme": ["api.anthropic.com"]}},
            {**snapshot(), "built_in": [{"host": "a b", "port": 1, "name": "gw"}]},
        ],
    )
    def test_a_malformed_snapshot_is_rejected_not_half_used(self, bad):
        with pytest.raises(ValueError, match=r"malformed policy snapshot|PolicySnapshot"):
            from_json(bad)

    @pytest.mark.parametrize(
        "entry", ["*.example", "Git.Example", "git.example:443", "git.example.", "8.8.8.8", ""]
    )
    def test_an_entry_not_in_the_grammars_form_matches_nothing(self, entry):
        """The proxy never parses entries: what is asked is put in the grammar's form, so an
        entry in any other form allows nothing (it fails closed)."""
        agent = from_json(snapshot(own=entry, lists=[])).agents[7]
        for host, port in [("a.example", 443), ("git.example", 443), ("8.8.8.8", 443)]:
            decision = by_name(agent, host, port, plain_http=False, at_capacity=False)
            assert not decision.allowed

    def test_a_list_the_snapshot_does_not_hold_is_empty(self):
        agent = from_json(snapshot(lists=["template:made-meanwhile"])).agents[7]
        decision = by_name(agent, "api.anthropic.com", 443, plain_http=False, at_capacity=False)
        assert decision.code is Code.NOT_ON_ALLOWLIST
        assert by_name(agent, "git.example", 8443, plain_http=False, at_capacity=False).allowed


class TestAddresses:
    @pytest.mark.parametrize(
        "address",
        [
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "127.0.0.1",
            "127.255.255.254",
            "0.0.0.0",
            "169.254.169.254",  # cloud metadata
            "100.64.0.1",  # carrier-grade NAT
            "100.127.255.254",
            "192.0.0.170",
            "198.18.0.1",
            "224.0.0.1",  # multicast
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "192.0.2.1",
            "::",
            "::1",
            "fe80::1",
            "fc00::1",
            "fd12:3456::1",
            "ff02::1",
            "::ffff:127.0.0.1",  # IPv4-mapped
            "::ffff:169.254.169.254",
            "::ffff:10.0.0.1",
            "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
            "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
            "64:ff9b:1::a00:1",
            "2002:7f00:1::1",  # 6to4 of 127.0.0.1
            "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
            "2001::1",  # Teredo
            "2001:db8::1",
            "::127.0.0.1",  # IPv4-compatible
            "fec0::1",
        ],
    )
    def test_non_public_addresses_are_refused(self, address):
        assert not is_public(ipaddress.ip_address(address))
        decision, chosen = by_address("h.example", 443, [address])
        assert decision.code is Code.NON_PUBLIC_ADDRESS
        assert chosen is None

    @pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
    def test_public_addresses_pass(self, address):
        decision, chosen = by_address("h.example", 443, [address])
        assert decision.allowed
        assert str(chosen) == address

    def test_one_bad_answer_among_good_ones_refuses_the_name(self):
        decision, _ = by_address("h.example", 443, ["8.8.8.8", "10.0.0.1", "1.1.1.1"])
        assert decision.code is Code.NON_PUBLIC_ADDRESS
        assert decision.detail == "10.0.0.1"

    def test_no_answer_is_unresolvable(self):
        decision, _ = by_address("h.example", 443, [])
        assert decision.code is Code.UNRESOLVABLE

    def test_allowed_private_networks_are_let_through(self):
        allowed = parse_networks(["10.20.0.0/16"])
        decision, chosen = by_address("mirror.corp", 443, ["10.20.1.2"], allowed)
        assert decision.allowed and str(chosen) == "10.20.1.2"
        mapped, _ = by_address("mirror.corp", 443, ["::ffff:10.20.1.2"], allowed)
        assert mapped.allowed
        outside, _ = by_address("mirror.corp", 443, ["10.21.0.1"], allowed)
        assert outside.code is Code.NON_PUBLIC_ADDRESS

    def test_ipv4_is_preferred(self):
        _, chosen = by_address("h.example", 443, ["2606:4700:4700::1111", "1.1.1.1"])
        assert str(chosen) == "1.1.1.1"


def test_an_entry_comes_from_every_list_that_holds_it_in_order(policy):
    agent = policy.agents[7]
    assert agent.sources(Entry("git.example", 443)) == ("base", "agent")
    assert agent.sources(Entry("git.example", 8443)) == ("agent",)
    assert agent.sources(Entry("unused.example", 443)) == ()
    assert agent.hosts == {"api.anthropic.com", "git.example", "deb.example"}


def test_shared_lists_are_held_once_for_every_agent():
    other = {**snapshot()["agents"][0], "id": 8, "username": "acme.other", "tokens": []}
    policy = from_json({**snapshot(), "agents": [snapshot()["agents"][0], other]})
    (base7, _, _), (base8, _, _) = policy.agents[7].lists, policy.agents[8].lists
    assert base7[1] is base8[1] is policy.lists["base:acme"]


class TestPipeline:
    """check_request → check_addresses → check_client_hello, in the order of the design: the
    first refusal is the answer, and who and what it was about stay on it."""

    def test_no_policy_refuses_everything_first(self):
        attempt = Attempt(basic("acme.builder", "s3cret"), "x", 1, problem="bad")
        assert check_request(None, attempt, NOW).code is Code.POLICY_UNAVAILABLE

    def test_a_malformed_request_is_refused_before_anyone_is_identified(self, policy):
        attempt = Attempt(None, "api.anthropic.com", 80, plain_http=True, problem="two Hosts")
        decision = check_request(policy, attempt, NOW)
        assert (decision.code, decision.detail, decision.agent) == (
            Code.BAD_REQUEST,
            "two Hosts",
            None,
        )

    def test_a_token_the_policy_never_saw_is_named_for_a_look_up_and_a_wrong_one_is_not(
        self, policy
    ):
        unseen = check_request(policy, Attempt(basic("acme.builder", "new"), "x", 443), NOW)
        assert unseen.code is Code.PROXY_AUTH and unseen.unknown_token == hash_token("new")
        assert unseen.username == "acme.builder"
        expired = Attempt(basic("acme.builder", "s3cret"), "x", 443)
        assert check_request(policy, expired, NOW + 60).unknown_token == ""

    def test_an_allow_carries_its_agent_its_entry_and_the_generation(self, policy):
        attempt = Attempt(basic("acme.builder", "s3cret"), "Git.Example.", 8443)
        decision = check_request(policy, attempt, NOW)
        assert decision.allowed and decision.agent is policy.agents[7]
        assert (decision.host, decision.port, decision.sources) == ("git.example", 8443, ("agent",))
        assert decision.generation == "g1" and decision.address is None

    def test_capacity_counts_tunnels_only(self, policy):
        full = lambda agent_id: agent_id == 7  # noqa: E731
        tunnel = Attempt(basic("acme.builder", "s3cret"), "deb.example", 80)
        assert check_request(policy, tunnel, NOW, full=full).code is Code.CAPACITY
        request = Attempt(basic("acme.builder", "s3cret"), "deb.example", 80, plain_http=True)
        assert check_request(policy, request, NOW, full=full).allowed

    def test_later_steps_keep_a_refusal_and_refine_an_allow(self, policy):
        attempt = Attempt(basic("acme.builder", "s3cret"), "git.example", 8443)
        refused = check_request(policy, replace_host(attempt, "other.example"), NOW)
        assert check_addresses(refused, ["8.8.8.8"]) is refused
        assert check_client_hello(refused, "other.example") is refused
        allowed = check_addresses(check_request(policy, attempt, NOW), ["8.8.8.8"])
        assert allowed.address == "8.8.8.8"
        assert check_client_hello(allowed, "GIT.example.") is allowed
        wrong = check_client_hello(allowed, "evil.example")
        assert wrong.code is Code.BAD_REQUEST and wrong.agent is policy.agents[7]
        assert "names 'evil.example', not the CONNECT host 'git.example'" in wrong.detail
        assert wrong.address == "8.8.8.8"  # what it would have dialled, for the log
        assert "no server (SNI)" in check_client_hello(allowed, "").detail
        not_tls = check_client_hello(allowed, "", "the tunnel did not start with a TLS ClientHello")
        assert not_tls.code is Code.BAD_REQUEST and "TLS ClientHello" in not_tls.detail


def replace_host(attempt, host):
    return Attempt(attempt.credential, host, attempt.port, attempt.plain_http)


class TestBuiltIn:
    """A destination the platform names for every agent (the model gateway): allowed as named,
    at any address, to that port alone, while the agent may connect at all."""

    GATEWAY = {"host": "172.17.0.1", "port": 8002, "name": "model gateway"}

    def policy(self, **agent_overrides):
        return from_json({**snapshot(**agent_overrides), "built_in": [self.GATEWAY]})

    def ask(self, policy, host, port, plain_http=True):
        attempt = Attempt(basic("acme.builder", "s3cret"), host, port, plain_http)
        return check_request(policy, attempt, NOW)

    def test_it_is_allowed_as_an_ip_literal_at_its_port_and_a_private_address(self):
        decision = self.ask(self.policy(), "172.17.0.1", 8002)
        assert decision.allowed and decision.sources == ("built-in: model gateway",)
        vetted = check_addresses(decision, ["172.17.0.1"])
        assert vetted.allowed and vetted.address == "172.17.0.1"
        assert self.ask(self.policy(), "172.17.0.1", 8002, plain_http=False).allowed

    def test_another_port_of_it_or_another_address_is_not(self):
        assert self.ask(self.policy(), "172.17.0.1", 8003).code is Code.IP_LITERAL
        assert self.ask(self.policy(), "172.17.0.2", 8002).code is Code.IP_LITERAL

    def test_a_disabled_or_used_up_agent_is_refused_there_too(self):
        assert self.ask(self.policy(enabled=False), "172.17.0.1", 8002).code is (
            Code.AGENT_DISABLED
        )
        used_up = self.policy(budget_exhausted=True)
        assert self.ask(used_up, "172.17.0.1", 8002).code is Code.BUDGET_EXHAUSTED

    def test_a_named_one_is_compared_canonically_and_its_refusal_loses_the_allowance(self):
        named = from_json(
            {**snapshot(), "built_in": [{"host": "Gateway.Corp.", "port": 443, "name": "gw"}]}
        )
        decision = self.ask(named, "GATEWAY.corp", 443, plain_http=False)
        assert decision.allowed and decision.host == "gateway.corp"
        refused = check_client_hello(check_addresses(decision, ["10.0.0.5"]), "evil.example")
        assert refused.code is Code.BAD_REQUEST and refused.built_in == ""

    def test_without_one_the_address_is_what_it_always_was(self):
        plain = from_json(snapshot())
        assert self.ask(plain, "172.17.0.1", 8002).code is Code.IP_LITERAL


# --- a delta from the policy stream ----------------------------------------------------------


def test_a_delta_replaces_its_agents_and_their_tokens_and_removes_the_gone():
    builder = snapshot()["agents"][0]
    other = {**builder, "id": 8, "username": "acme.other",
             "tokens": [{"sha256": hash_token("other"), "expires_at": NOW + 60}]}  # fmt: skip
    policy = from_json({**snapshot(), "agents": [builder, other]})
    changed = {
        **builder,
        "lists": [],
        "own": "new.example",
        "tokens": [{"sha256": hash_token("fresh"), "expires_at": NOW + 60}],
    }
    delta = PolicyDelta.from_json(
        {"since": policy.generation, "generation": "g2", "agents": [changed], "removed": [8]}
    )
    applied = policy.apply(delta)
    assert applied.generation == "g2"
    assert set(applied.agents) == {7}
    assert [(n, held.texts) for n, held in applied.agents[7].lists] == [("agent", ("new.example",))]
    # The changed agent's old token is gone with it; the removed agent's too.
    assert set(applied.tokens) == {hash_token("fresh")}
    assert applied.built_in == policy.built_in
    assert set(policy.agents) == {7, 8}  # the old policy is untouched (decisions in flight)


def test_a_delta_from_another_generation_is_refused():
    policy = from_json(snapshot())
    with pytest.raises(ValueError, match="a delta from g0"):
        policy.apply(PolicyDelta(since="g0", generation="g1"))


def test_a_delta_of_a_shared_list_reaches_every_agent_that_has_it_and_no_other():
    builder = snapshot()["agents"][0]
    other = {**builder, "id": 8, "username": "acme.other", "tokens": [],
             "lists": ["template:debian-ubuntu"]}  # fmt: skip
    policy = from_json({**snapshot(), "agents": [builder, other]})
    delta = PolicyDelta.from_json(
        {
            "since": "g1",
            "generation": "g2",
            "lists": {"base:acme": "mirror.example"},
            "lists_removed": ["template:unused"],
        }
    )
    applied = policy.apply(delta)
    ask = lambda agent_id, host: check_request(  # noqa: E731
        applied, Attempt(basic("acme.builder", "s3cret"), host, 443), NOW
    ) if agent_id == 7 else by_name(applied.agents[8], host, 443, plain_http=False,
                                    at_capacity=False)  # fmt: skip
    assert ask(7, "mirror.example").allowed
    assert ask(7, "api.anthropic.com").code is Code.NOT_ON_ALLOWLIST
    assert ask(7, "git.example").sources == ("agent",)
    assert not ask(8, "mirror.example").allowed
    assert applied.agents[8] is policy.agents[8]  # untouched
    assert set(applied.lists) == {"base:acme", "template:debian-ubuntu"}
    assert policy.agents[7].sources(Entry("api.anthropic.com")) == ("base",)  # the old one
