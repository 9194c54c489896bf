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
