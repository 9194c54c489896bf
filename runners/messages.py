"""The runner protocol's messages (runners/protocol.py) as DRF serializers: the control plane
validates and answers with these, and the OpenAPI schema describes them. A body is parsed once,
here: a view gets the message's dataclass, or the caller a 400 naming what does not fit."""

from typing import Any

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers
from rest_framework_dataclasses.serializers import DataclassSerializer

from runners import protocol
from runners.probe import checks


class MessageSerializer(DataclassSerializer):
    """A message whose own check (its ``__post_init__``: a ValueError that names the field,
    as wire/ has it) refuses it answers 400 naming that field, not 500."""

    def to_internal_value(self, data: Any) -> Any:
        try:
            return super().to_internal_value(data)
        except ValueError as exc:
            field, _, why = str(exc).partition(": ")
            raise serializers.ValidationError({field: [why]}) from None


class HeartbeatSerializer(MessageSerializer):
    class Meta:
        dataclass = protocol.Heartbeat
        extra_kwargs: dict[str, dict[str, Any]] = {
            "problem": {
                "allow_blank": True,
                "trim_whitespace": False,
                "max_length": protocol.MAX_PROBLEM_CHARS,
            },
        }


class PauseOrderSerializer(MessageSerializer):
    class Meta:
        dataclass = protocol.PauseOrder


class ProbeBeginSerializer(MessageSerializer):
    class Meta:
        dataclass = protocol.ProbeBegin
        extra_kwargs: dict[str, dict[str, Any]] = {
            "reason": {"allow_blank": True, "max_length": 100},
        }


class ProbeResultSerializer(MessageSerializer):
    class Meta:
        dataclass = checks.Result
        extra_kwargs: dict[str, dict[str, Any]] = {
            "category": {"max_length": 40},
            "target": {"max_length": 300},
            "observed": {"allow_blank": True, "max_length": 1000},
        }


class ProbeReportSerializer(MessageSerializer):
    checks = ProbeResultSerializer(many=True)

    class Meta:
        dataclass = protocol.ProbeReport
        extra_kwargs: dict[str, dict[str, Any]] = {
            "detail": {"allow_blank": True, "max_length": 2000},
        }


class RunStartSerializer(MessageSerializer):
    class Meta:
        dataclass = protocol.RunStart


class RegistrationSerializer(MessageSerializer):
    class Meta:
        dataclass = protocol.Registration
        extra_kwargs: dict[str, dict[str, Any]] = {
            "name": {"max_length": 100},
        }


class LaunchSpecSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.LaunchSpec


class ActiveRunsSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.ActiveRuns


class ServiceRecordSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.ServiceRecord
        extra_kwargs: dict[str, dict[str, Any]] = {
            "name": {"max_length": 63},
            "image_id": {"max_length": 100, "allow_blank": True},
            "log": {
                "allow_blank": True,
                "trim_whitespace": False,
                "max_length": protocol.MAX_SERVICE_LOG_CHARS,
            },
        }


class RunReportSerializer(DataclassSerializer):
    services = ServiceRecordSerializer(many=True, required=False)

    class Meta:
        dataclass = protocol.RunReport
        extra_kwargs: dict[str, dict[str, Any]] = {
            "detail": {"max_length": 400, "allow_blank": True, "trim_whitespace": False},
            "log_tail": {"allow_blank": True, "trim_whitespace": False},
            "image_id": {"max_length": 100, "allow_blank": True},
        }


class RunStatusAnswerSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.RunStatusAnswer


class ProbePlanSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.ProbePlan


class ProbeStatusAnswerSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.ProbeStatusAnswer


class OutputChunkSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.OutputChunk
        extra_kwargs: dict[str, dict[str, Any]] = {
            "offset": {"min_value": 0},
            # A cheap first bound (characters); the bytes are counted where it is kept.
            "text": {
                "allow_blank": True,
                "trim_whitespace": False,
                "max_length": protocol.MAX_OUTPUT_CHUNK_BYTES,
            },
        }


class OutputAnswerSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.OutputAnswer


class RunnerInfoSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.RunnerInfo


# A refusal: {"detail": why} (DRF's own shape).
Refusal = inline_serializer("Refusal", {"detail": serializers.CharField()})


class HomeOrderSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.HomeOrder


class HomeAnswerSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.HomeAnswer


class HomeEntrySerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.HomeEntry


class HomeSpaceSerializer(DataclassSerializer):
    class Meta:
        dataclass = protocol.HomeSpace
