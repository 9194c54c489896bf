"""A run's output as its page shows it (runs/output.py): the tail kept on the run, live and
from the whole log."""

import pytest
from django.utils import timezone

from runners.models import Runner
from runs import output
from runs import services as runs
from runs.services import LOG_TAIL_CHARS
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db

# Indented lines, as a traceback or JSON prints them; more of them than the tail holds.
LINES = [f"{' ' * (4 * (n % 4))}line {n:05}\n" for n in range(2000)]


@pytest.fixture
def run(acme):
    runner = Runner.objects.get(organisation=acme, builtin=True)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now())
    run = runs.queue_run(AgentFactory(organisation=acme), "build")
    runs.start(str(run.pk), run.runner)
    run.refresh_from_db()
    return run


def whole_lines(tail: str) -> bool:
    """Whether every line of ``tail`` is one the run wrote, its indentation kept."""
    return tail.endswith("\n") and all(
        line + "\n" in LINES for line in tail.removesuffix("\n").split("\n")
    )


def test_the_tail_of_live_output_starts_with_a_whole_line(run):
    offset = 0
    for start in range(0, len(LINES), 37):  # pieces of lines; the tail is cut all over them
        piece = "".join(LINES[start : start + 37])
        kept = output.append_output(str(run.pk), run.runner, offset, piece)
        assert kept is not None
        offset = kept.output_size
        assert len(kept.log_tail) <= LOG_TAIL_CHARS
        assert whole_lines(kept.log_tail), repr(kept.log_tail[:40])
    assert kept.log_tail.endswith(LINES[-1]) and len(kept.log_tail) > LOG_TAIL_CHARS - 100


def test_the_tail_of_a_whole_log_starts_with_a_whole_line(run):
    for cut in range(1, 20):  # wherever the cut falls in a line, its indentation included
        text = "x" * cut + "".join(LINES)
        kept = output.save_log(str(run.pk), run.runner, text)
        assert kept is not None and whole_lines(kept.log_tail), repr(kept.log_tail[:40])
        assert kept.log_tail == text[-len(kept.log_tail) :]


def test_a_last_line_longer_than_the_tail_is_shown_by_its_end():
    line = "y" * (LOG_TAIL_CHARS + 10) + "\n"
    assert output.tail_of("a\n" + line) == line[-LOG_TAIL_CHARS:]
    assert output.tail_of("short\n") == "short\n"


def test_the_run_page_shows_the_tail_as_it_is(run, operator_client):
    """HTML drops a newline right after <pre>: the page puts its own there, so a tail that
    starts with an empty line or indentation is shown as it is (a browser's text of the <pre>
    is the tail exactly)."""
    tail = "\n    indented\n  and less\n"
    output.append_output(str(run.pk), run.runner, 0, tail)
    page = operator_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert 'white-space: pre-wrap">\n' + tail + "</pre>" in page
