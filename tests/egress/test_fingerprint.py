"""The policy's fingerprint (egress.services.policy_fingerprint), which every proxy's poll
compares: it changes with each thing the policy is made of, of the organisation asked about
(or of any, unscoped), and with nothing else."""

import pytest

from egress.services import issue_token, policy_fingerprint, revoke_tokens
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory, OrganisationFactory

pytestmark = pytest.mark.django_db


def test_it_changes_with_each_part_of_its_organisations_policy_and_nothing_else(acme):
    other = OrganisationFactory(name="Other")
    agent = AgentFactory(organisation=acme, name="Builder")
    theirs = AgentFactory(organisation=other, name="Theirs")
    seen = {policy_fingerprint(acme.pk)}

    def changed() -> bool:
        now = policy_fingerprint(acme.pk)
        new = now not in seen
        seen.add(now)
        return new

    assert not changed()  # asking again is the same answer
    AgentFactory(organisation=acme, name="Second")
    assert changed()
    agent.enabled = False
    agent.save()
    assert changed()
    acme.save()  # its base list, say
    assert changed()
    template = AllowlistTemplate.objects.get(slug="pypi")
    template.save()
    assert changed()
    token, _ = issue_token(agent)
    assert changed()
    revoke_tokens([token])
    assert changed()

    # Another organisation's changes are not this one's policy; unscoped, they count.
    everyone = policy_fingerprint()
    theirs.enabled = False
    theirs.save()
    issue_token(theirs)
    other.save()
    assert not changed()
    assert policy_fingerprint() != everyone
