"""A run's output: pieces its runner sends while the sandbox runs, the whole log once it has
ended, and reading either from a byte offset (what the API and the admin serve)."""

from django.core.exceptions import ValidationError
from django.core.files.base import ContentFile
from django.db import transaction
from django.http import FileResponse, HttpResponse, HttpResponseBase

from runners.models import Runner
from runners.protocol import MAX_OUTPUT_CHUNK_BYTES, cut_at_character, printable
from runs.models import FINISHED, Run, RunOutput
from runs.services import LOG_TAIL_CHARS, runners_run

# Live output: a run takes at most this much before its sandbox ends (a chunk at most
# runners.protocol.MAX_OUTPUT_CHUNK_BYTES). The whole log then replaces it; Docker keeps the last
# 10 to 20 MB of a sandbox's output (runners/host/containers/engine.py), so live output stops
# below that, and a whole log that lost its start says how much (Run.log_start).
MAX_LIVE_OUTPUT_BYTES = 16 * 1024 * 1024
MAX_LIVE_ANSWER_BYTES = 1024 * 1024  # of live output per answer: ask again from where it ends


@transaction.atomic
def save_log(run_id: str, runner: Runner, text: str, total: int | None = None) -> Run | None:
    """Keep a run's whole output and its tail (a runner sends it once the sandbox ended); it
    replaces the output sent while the run went. ``total``: how many bytes the sandbox wrote
    in all, when the runner counted them; the log lacks the difference at its start (Docker
    keeps only the last of a large output), which ``Run.log_start`` records so that offsets
    into the output stay the same."""
    run = runners_run(run_id, runner)
    if run is None:
        return None
    if run.log:
        run.log.delete(save=False)
    text = printable(text)
    data = text.encode()
    run.log.save(f"{run.pk}.log", ContentFile(data), save=False)
    run.log_tail = tail_of(text)
    run.log_start = max(0, (total or 0) - len(data))
    run.output_size = run.log_start + len(data)
    Run.objects.filter(pk=run.pk).update(
        log=run.log.name,
        log_tail=run.log_tail,
        output_size=run.output_size,
        log_start=run.log_start,
    )
    RunOutput.objects.filter(run=run).delete()
    return run


def tail_of(text: str) -> str:
    """The end of a run's output that its page shows: at most LOG_TAIL_CHARS characters, from
    the start of a line when the output is longer (a line cut part-way showed its end as if
    it were the line, its indentation lost), unless the last line alone is that long."""
    if len(text) <= LOG_TAIL_CHARS:
        return text
    kept = text[-LOG_TAIL_CHARS:]
    if text[-LOG_TAIL_CHARS - 1] == "\n":
        return kept  # cut at the start of a line already
    newline = kept.find("\n")
    return kept[newline + 1 :] if 0 <= newline < len(kept) - 1 else kept


class OutputConflict(Exception):
    """Output sent at another offset than the run's size; ``size`` is where to go on from."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the run has {size} bytes of output; send from there")
        self.size = size


class OutputClosed(Exception):
    """The run takes no more live output (it has ended, or has as much as it keeps): the whole
    log comes at the end."""

    def __init__(self, size: int, why: str) -> None:
        super().__init__(why)
        self.size = size


@transaction.atomic
def append_output(run_id: str, runner: Runner, offset: int, text: str) -> Run | None:
    """Keep output a runner sent while the sandbox runs, at ``offset`` bytes into it.

    OutputConflict when the offset is not the run's current size (a resend, or a runner that
    restarted: it goes on from the size it is told); OutputClosed when the run has ended or
    would pass MAX_LIVE_OUTPUT_BYTES. None: not this runner's run."""
    run = runners_run(run_id, runner)
    if run is None:
        return None
    if run.log or run.status in FINISHED:
        raise OutputClosed(run.output_size, "the run has ended: send its whole log")
    if offset != run.output_size:
        raise OutputConflict(run.output_size)
    text = printable(text)
    size = len(text.encode())
    if size > MAX_OUTPUT_CHUNK_BYTES:
        raise ValidationError(
            {"text": [f"a chunk is at most {MAX_OUTPUT_CHUNK_BYTES} bytes of UTF-8, not {size}"]}
        )
    if run.output_size + size > MAX_LIVE_OUTPUT_BYTES:
        raise OutputClosed(
            run.output_size,
            f"a run takes {MAX_LIVE_OUTPUT_BYTES} bytes of output while it goes: the rest"
            " comes with its whole log",
        )
    if not text:
        return run
    RunOutput.objects.create(run=run, start=offset, end=offset + size, text=text)
    run.output_size += size
    run.log_tail = tail_of(run.log_tail + text)
    Run.objects.filter(pk=run.pk).update(output_size=run.output_size, log_tail=run.log_tail)
    return run


def log_response(run: Run, offset: int = 0) -> HttpResponseBase:
    """The run's output as text from ``offset`` bytes on. The headers say where to ask from
    next (``X-Covey-Log-Size``, a byte count), whether more can come (``X-Covey-Log-Complete``:
    the run has ended and everything up to that size was given) and, when the whole log lacks
    the start of a large output, how much (``X-Covey-Log-Start``). A whole log is streamed;
    live output comes at most MAX_LIVE_ANSWER_BYTES at a time."""
    finished = run.status in FINISHED
    headers = {"X-Covey-Log-Start": str(run.log_start)}
    if run.log:
        file = run.log.open("rb")
        length = file.size
        skip = min(max(0, offset - run.log_start), length)
        file.seek(skip)
        response: HttpResponseBase = FileResponse(file, content_type=TEXT)
        response["Content-Length"] = str(length - skip)
        size = run.log_start + length
    else:
        # A finished run without a whole log (its runner lost it): what arrived is all.
        data, size, finished = output_since(run, offset)
        response = HttpResponse(data, content_type=TEXT)
    for name, value in headers.items():
        response[name] = value
    response["X-Covey-Log-Size"] = str(size)
    response["X-Covey-Log-Complete"] = "true" if finished else "false"
    return response


TEXT = "text/plain; charset=utf-8"


def output_since(run: Run, offset: int) -> tuple[bytes, int, bool]:
    """What the run page follows: the output from ``offset`` bytes on, at most
    MAX_LIVE_ANSWER_BYTES (cut at a character) from the whole log or from live output, the
    offset it ends at, and whether the run has ended with nothing more to come."""
    if not run.log:
        data, size = _live_output(run, offset)
        return data, size, run.status in FINISHED and size >= run.output_size
    with run.log.open("rb") as file:
        length = file.size
        skip = min(max(0, offset - run.log_start), length)
        file.seek(skip)
        data = file.read(MAX_LIVE_ANSWER_BYTES + 4)  # a character's bytes past the cut
    data = data[: cut_at_character(data, MAX_LIVE_ANSWER_BYTES)]
    return (
        data,
        run.log_start + skip + len(data),
        run.status in FINISHED and (skip + len(data) >= length),
    )


def _live_output(run: Run, offset: int) -> tuple[bytes, int]:
    """Live output from ``offset`` on (at most MAX_LIVE_ANSWER_BYTES, whole pieces cut at a
    character) and the offset it ends at."""
    if run.output_size == 0:
        # Nothing arrived live; a run from before live output has its tail, and that is all.
        tail = run.log_tail.encode() if offset == 0 else b""
        return tail, len(tail)
    offset = min(max(0, offset), run.output_size)
    pieces = RunOutput.objects.filter(run=run, end__gt=offset, start__lt=run.output_size)
    taken: list[bytes] = []
    end = offset
    for start, text in pieces.order_by("start").values_list("start", "text").iterator():
        data = text.encode()[max(0, offset - start) :]
        room = MAX_LIVE_ANSWER_BYTES - (end - offset)
        if len(data) > room:
            cut = cut_at_character(data, room)
            taken.append(data[:cut])
            end += cut
            break
        taken.append(data)
        end += len(data)
    return b"".join(taken), end
