"""factory-boy factories; agents and organisations are made through the services."""

import factory
from django.contrib.auth import get_user_model

from agents import services
from agents.models import Agent, Organisation
from workplaces.models import Workplace


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ["username"]

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("a-long-test-password")


class OrganisationFactory(factory.Factory):
    class Meta:
        model = Organisation

    name = factory.Sequence(lambda n: f"Organisation {n}")

    @classmethod
    def _create(cls, model_class, name, **kwargs):
        return services.create_organisation(name, **kwargs)


class AgentFactory(factory.Factory):
    class Meta:
        model = Agent

    organisation = factory.SubFactory(OrganisationFactory)
    name = factory.Sequence(lambda n: f"agent {n}")

    @classmethod
    def _create(cls, model_class, organisation, name, **kwargs):
        return services.create_agent(organisation, name, **kwargs)


class WorkplaceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Workplace

    organisation = factory.SubFactory(OrganisationFactory)
    name = factory.Sequence(lambda n: f"workplace {n}")
    image = "covey/base:bookworm"
