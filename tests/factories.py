"""factory-boy factories; agents and organisations are made through the services."""

import time
import uuid
from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.utils import timezone

from agents import services
from agents.models import Agent
from egress.protocol import DecisionBatch
from egress.services import record_decisions
from organisations import services as organisations
from organisations.models import Organisation
from runners.models import Runner
from runners.services import create_registration_token, register_runner
from workplaces.models import Workplace
from workplaces.services import create_workplace


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ["username"]

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("a-long-test-password")


def server_user(username: str, password: str, **fields: Any) -> Any:
    """A user who signs in to a control plane the test started (another process): the
    password hashed by the product's own hasher, not the quick one the tests use
    (tests/conftest.py)."""
    user: Any = UserFactory(username=username, **fields)
    user.password = make_password(password, hasher="pbkdf2_sha256")
    user.save(update_fields=["password"])
    return user


class OrganisationFactory(factory.Factory):
    class Meta:
        model = Organisation

    name = factory.Sequence(lambda n: f"Organisation {n}")

    @classmethod
    def _create(cls, model_class, name, **kwargs):
        return organisations.create_organisation(name, **kwargs)


class AgentFactory(factory.Factory):
    class Meta:
        model = Agent

    organisation = factory.SubFactory(OrganisationFactory)
    name = factory.Sequence(lambda n: f"agent {n}")

    @classmethod
    def _create(cls, model_class, organisation, name, **kwargs):
        return services.create_agent(organisation, name, **kwargs)


class WorkplaceFactory(factory.Factory):
    class Meta:
        model = Workplace

    organisation = factory.SubFactory(OrganisationFactory)
    name = factory.Sequence(lambda n: f"workplace {n}")
    image = "covey/base:bookworm"

    @classmethod
    def _create(cls, model_class, organisation, name, image, **kwargs):
        return create_workplace(organisation, name, image, **kwargs)


def decision_event(agent=None, **fields) -> dict:
    """One decision as a proxy reports it (egress.services.record_decisions): an allowed
    tunnel of ``agent`` unless ``fields`` say otherwise."""
    return {
        "event": "decision",
        "id": str(uuid.uuid4()),
        "agent_id": agent.pk if agent else None,
        "username": "acme.builder",
        "kind": "connect",
        "host": "good.example",
        "port": 443,
        "address": "203.0.113.9",
        "allowed": True,
        "reason": "allowed",
        "detail": "agent",
        "at": time.time(),
        **fields,
    }


def record_events(events, **kwargs) -> int:
    """egress.services.record_decisions of events as a proxy posts them (JSON), parsed as the
    control plane's door parses them (egress.protocol.DecisionBatch)."""
    return record_decisions(DecisionBatch.from_json({"events": list(events)}).events, **kwargs)


def online_runner(organisation, name="edge-1", labels=(), paused=False) -> tuple[Runner, str]:
    _, secret = create_registration_token(organisation)
    runner, token = register_runner(secret, name, labels)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now(), paused=paused)
    runner.refresh_from_db()
    return runner, token


def runner_api(client, token):
    client.credentials(HTTP_AUTHORIZATION=f"Runner {token}")
    return client
