"""Prove what a sandbox can reach: order an egress probe on runners and print what it saw.

The probe runs on the runner host (the order goes through the runner's Celery queue), in a
container placed exactly like a sandbox; this command waits for the report. One line per check;
the exit status is 0 when every probed runner passed, 1 when anything leaked or failed, 2 when
a runner did not report in time.
"""

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.models import Agent
from agents.services import find_agent
from allowlists.entries import EntryError
from organisations.services import find_one
from runners.models import Probe, ProbeStatus, Runner
from runners.probe import service as probes


class Command(BaseCommand):
    help = (
        "Run the egress probe on a runner (default: every online runner) and print one line per"
        " check; exits non-zero on any leak."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--runner", help="id, name, or org-slug/name")
        parser.add_argument(
            "--agent",
            help="probe as this agent (id, slug or org-slug/agent-slug); default: the"
            " organisation's first enabled agent that may reach the allowed vendor",
        )
        parser.add_argument(
            "--timeout", type=float, default=120.0, help="seconds to wait for the reports"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        agent = None
        if options["agent"]:
            try:
                agent = find_agent(options["agent"])
            except (Agent.DoesNotExist, Agent.MultipleObjectsReturned) as exc:
                raise CommandError(str(exc)) from None
        runners = self._runners(options["runner"], agent)
        ordered = []
        for runner in runners:
            try:
                ordered.append(
                    probes.order_probe(runner, agent=agent, reason="manage.py egress_probe")
                )
            except (ValidationError, EntryError) as exc:
                raise CommandError(f"runner {runner.name}: {probes.words(exc)}") from None
        found = probes.wait(ordered, options["timeout"])
        late = [p for p in found if p.status == ProbeStatus.PENDING]
        for probe in found:
            self._print(probe, options["timeout"])
        if late:
            names = ", ".join(p.runner.name for p in late)
            raise CommandError(
                f"no report from {names} within {options['timeout']:g} s", returncode=2
            )
        bad = [p for p in found if p.status != ProbeStatus.PASSED]
        if bad:
            raise CommandError(
                "; ".join(f"{p.runner.name}: {p.status}: {p.summary}" for p in bad), returncode=1
            )

    def _runners(self, reference: str | None, agent: Agent | None) -> list[Runner]:
        runners = Runner.objects.select_related("organisation")
        if agent is not None:
            runners = runners.filter(organisation_id=agent.organisation_id)
        if reference is None:
            online = [r for r in runners if r.online]
            if not online:
                raise CommandError("no runner is online (start one: manage.py runner)")
            return online
        try:
            return [find_one(runners, reference, "name", "runner")]
        except (Runner.DoesNotExist, Runner.MultipleObjectsReturned) as exc:
            raise CommandError(str(exc)) from None

    def _print(self, probe: Probe, timeout: float) -> None:
        runner = probe.runner
        who = f"as {probe.agent}" if probe.agent else "as no agent"
        mode = f"{probe.isolation} isolation" if probe.isolation else "not started"
        self.stdout.write(
            f"egress probe of runner {runner.name} ({runner.organisation}), {mode}, {who}"
        )
        if probe.status == ProbeStatus.PENDING:
            self.stdout.write(f"  no report within {timeout:g} s: is its runner host running?")
            return
        for line in probes.lines(probe):
            self.stdout.write(f"  {line}")
        self.stdout.write(f"  {probe.status}: {probe.summary}")
