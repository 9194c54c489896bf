"""The runner protocol's messages (runners/protocol.py) as DRF serializers: the control plane
validates and answers with these, and the OpenAPI schema describes them."""

from typing import Any

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers
from rest_framework_dataclasses.serializers import DataclassSerializer

from runners import protocol


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
