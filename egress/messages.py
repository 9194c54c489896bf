"""The egress wires (egress/protocol.py) as DRF serializers, for the OpenAPI schema of what
runners' proxies call: the policy they read and the decision batches they post. The bodies
themselves are parsed with ``from_json`` at the door (strict, naming the field); these describe
them."""

from typing import Any

from drf_spectacular.utils import PolymorphicProxySerializer
from rest_framework import serializers
from rest_framework_dataclasses.serializers import DataclassSerializer

from egress import protocol


class PolicySnapshotSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.PolicySnapshot


class _TokenV1Serializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.TokenSnapshot


class _AgentV1Serializer(serializers.Serializer):
    """One agent as a proxy of before shared lists reads it: its whole allowlist."""

    id = serializers.IntegerField()
    username = serializers.CharField()
    organisation = serializers.CharField()
    enabled = serializers.BooleanField()
    budget_exhausted = serializers.BooleanField()
    entries = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        help_text="entry → where it comes from (base, template:<slug>, agent)",
    )
    tokens = _TokenV1Serializer(many=True)


class _BuiltInV1Serializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.BuiltIn


class PolicySnapshotV1Serializer(serializers.Serializer):
    """The policy as a proxy of before shared lists reads it (asked for without ``?v=2``)."""

    generation = serializers.CharField()
    agents = _AgentV1Serializer(many=True)
    built_in = _BuiltInV1Serializer(many=True)


PolicySerializer = PolymorphicProxySerializer(
    component_name="Policy",
    serializers=[PolicySnapshotSerializer, PolicySnapshotV1Serializer],
    resource_type_field_name=None,
)


def policy_forms_any_of(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular's hook: a policy with no agents fits either form, so the policy's answer
    is any of them (drf-spectacular says one of them)."""
    policy = result.get("components", {}).get("schemas", {}).get("Policy", {})
    if "oneOf" in policy:
        policy["anyOf"] = policy.pop("oneOf")
    return result


class DecisionEventSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.DecisionEvent


class CloseEventSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.CloseEvent


class StartEventSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.StartEvent


class StopEventSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.StopEvent


SERIALIZERS: dict[protocol.EventKind, Any] = {
    protocol.EventKind.DECISION: DecisionEventSerializer,
    protocol.EventKind.CLOSE: CloseEventSerializer,
    protocol.EventKind.START: StartEventSerializer,
    protocol.EventKind.STOP: StopEventSerializer,
}


class DecisionBatchSerializer(serializers.Serializer):
    """A batch of events from a proxy (egress.protocol.DecisionBatch), told apart by ``event``."""

    events = PolymorphicProxySerializer(
        component_name="ProxyEvent",
        serializers={kind.value: serializer for kind, serializer in SERIALIZERS.items()},
        resource_type_field_name="event",
        many=True,
    )


class BatchRefusalSerializer(serializers.Serializer):
    """Why a batch was refused: a body that is not JSON (``detail``), or events that do not fit
    (``events``, what is wrong with which)."""

    detail = serializers.CharField(required=False)
    events = serializers.ListField(child=serializers.CharField(), required=False)


class RecordedSerializer(serializers.Serializer):
    """How many events of a batch were taken."""

    recorded = serializers.IntegerField()
