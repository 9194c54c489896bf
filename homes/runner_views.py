"""The runner's API of agents' homes (``/api/v1/runner/home/…``, with its runner token): the
runner holding a home takes an operation ordered to it, answers it and moves its bytes. What
people call is homes/views.py."""

import time
import uuid
from typing import Any

from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework.request import Request
from rest_framework.response import Response

import jsonbodies
from homes import services, wire
from homes.models import HomeOperation, OperationState
from runners.auth import RunnerEndpoint
from runners.messages import HomeAnswerSerializer, HomeOrderSerializer, Refusal
from runners.protocol import (
    CHANGING,
    HOME_ANSWER_HEADER,
    HomeAnswer,
    HomeOp,
    HomeOrder,
    ProtocolError,
)


class RunnerHomeView(RunnerEndpoint):
    """An endpoint about one home operation ordered to the calling runner (404 for another's)."""

    def operation(self, request: Request, operation_id: uuid.UUID) -> HomeOperation:
        return get_object_or_404(
            HomeOperation.objects.select_related("runner"),
            pk=operation_id,
            runner=self.runner(request),
        )


class RunnerHomeTakeView(RunnerHomeView):
    """Take an operation ordered to this runner: what to do. 410 when it is no longer wanted."""

    @extend_schema(request=None, responses={200: HomeOrderSerializer, 410: Refusal})
    def post(self, request: Request, operation_id: uuid.UUID) -> Response:
        op = self.operation(request, operation_id)
        taken = HomeOperation.objects.filter(pk=op.pk, state=OperationState.ORDERED).update(
            state=OperationState.TAKEN
        )
        if not taken:
            return Response(
                {"detail": f"the operation is {op.state}: not to be taken"},
                status=status.HTTP_410_GONE,
            )
        return Response(op.order)


class RunnerHomeAnswerView(RunnerHomeView):
    """What came of an operation this runner took. A change's answer settles its record even
    when its asker has given up waiting (the change was made all the same)."""

    @extend_schema(request=HomeAnswerSerializer, responses={204: None, 410: Refusal})
    def post(self, request: Request, operation_id: uuid.UUID) -> Response:
        op = self.operation(request, operation_id)
        try:
            answer = HomeAnswer.from_json(request.data)
        except ProtocolError as exc:
            raise exceptions.ValidationError(str(exc)) from None
        answered = HomeOperation.objects.filter(
            pk=op.pk, state__in=[OperationState.TAKEN, OperationState.STREAMING]
        ).update(state=OperationState.ANSWERED, answer=answer.to_json())
        if op.kind in CHANGING and (answered or op.state == OperationState.ABANDONED):
            services.settle(op.pk, answer)
            return Response(status=status.HTTP_204_NO_CONTENT)
        if not answered:
            return Response(
                {"detail": f"the operation is {op.state}: no answer is wanted"},
                status=status.HTTP_410_GONE,
            )
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunnerHomeBodyView(RunnerHomeView):
    """An operation's bytes: an upload's, fetched (GET); a download's, sent (PUT, with the
    answer in the X-Covey-Home-Answer header) and read by the asker as they come."""

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    def get(self, request: Request, operation_id: uuid.UUID) -> Any:
        op = self.operation(request, operation_id)
        if op.kind != HomeOp.WRITE or op.state != OperationState.TAKEN:
            return Response(
                {"detail": f"no upload to fetch for this {op.kind} ({op.state})"},
                status=status.HTTP_410_GONE,
            )
        spooled = services.upload_path(op.pk)
        if not spooled.exists():
            return Response({"detail": "the upload is gone"}, status=status.HTTP_410_GONE)
        size = HomeOrder.from_json(op.order).size
        response = StreamingHttpResponse(
            services.follow(spooled, wire=wire.sender(request._request), size=size),
            content_type="application/octet-stream",
        )
        response["Content-Length"] = str(size)  # a broken upload is a cut response
        return response

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={204: None, 410: Refusal},
    )
    def put(self, request: Request, operation_id: uuid.UUID) -> Response:
        """A download's bytes, spooled as they come and read by its asker meanwhile: the runner
        is held back while it is more than a window ahead of the reader, and stopped (410) once
        the reader has left."""
        op = self.operation(request, operation_id)
        try:
            raw = request.headers.get(HOME_ANSWER_HEADER, "")
            answer = HomeAnswer.from_json(jsonbodies.loads(raw))
        except (ValueError, ProtocolError) as exc:
            raise exceptions.ValidationError({HOME_ANSWER_HEADER: str(exc)}) from None
        chunks, size = wire.body(request._request)
        spooled = services.download_path(op.pk)
        end = services.end_of(spooled)
        try:
            file = open(spooled, "xb", buffering=0)  # noqa: SIM115 (closed below)
        except FileExistsError:
            return _gone(f"the operation's bytes are coming already ({op.state})")
        with file:
            streaming = HomeOperation.objects.filter(pk=op.pk, state=OperationState.TAKEN)
            if not streaming.update(state=OperationState.STREAMING, answer=answer.to_json()):
                spooled.unlink()
                return _gone(f"the operation is {op.state}: its bytes are not wanted")
            written, checked = 0, 0
            outcome = "broken off"
            reader = services.Position(spooled)
            try:
                for data in chunks:
                    file.write(data)
                    written += len(data)
                    if written - checked >= services.WINDOW or (
                        written - reader.get() > services.WINDOW
                    ):
                        checked = written
                        if not _keep_up(op, reader, written):
                            outcome = "its asker left"
                            return _gone("the operation is no longer wanted (its asker left)")
                if size is not None and written != size:
                    outcome = f"{written} bytes came of {size}"
                else:
                    outcome = "whole"
            finally:
                reader.close()
                services.mark_end(end, outcome)
        HomeOperation.objects.filter(pk=op.pk, state=OperationState.STREAMING).update(
            state=OperationState.ANSWERED
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


def _keep_up(op: HomeOperation, reader: services.Position, written: int) -> bool:
    """Wait while the reader is more than a window behind; False once it has left."""
    deadline = time.monotonic() + services.IDLE_SECONDS
    while True:
        op.refresh_from_db(fields=["state"])
        if op.state == OperationState.ABANDONED:
            return False
        if written - reader.get() <= services.WINDOW:
            return True
        if time.monotonic() > deadline:
            return False  # the reader stood still: it is broken off on its side too
        time.sleep(0.05)


def _gone(detail: str) -> Response:
    return Response({"detail": detail}, status=status.HTTP_410_GONE)
