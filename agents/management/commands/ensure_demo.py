"""On a new installation (no organisation yet), make a demo organisation and agent, and print
the two lines that start a run of it through the API and follow its log."""

import json
import shlex
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.urls import reverse
from rest_framework.authtoken.models import Token

from agents.services import create_agent
from organisations.models import Organisation
from organisations.services import create_organisation
from templates.models import AllowlistTemplate

DEMO_TEMPLATES = ("github", "pypi")  # attached as an example of what an agent may reach
DEMO_TASK = "Write hello.py, a program that prints a greeting, run it, and say what it printed."


class Command(BaseCommand):
    help = (
        "On an installation with no organisation: make the organisation 'Demo' (the superuser"
        " admin its admin) and its agent 'demo' (the default workplace; templates github and"
        " pypi), and print how to start a run of it through the API and follow its log, with"
        " an API token of admin's shown this once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--url", default="http://127.0.0.1:8000", help="Where the API answers (printed)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if Organisation.objects.exists():
            return
        admin = get_user_model().objects.filter(username="admin", is_superuser=True).first()
        if admin is None:
            raise CommandError("no superuser 'admin' to own the demo: run ensure_admin first")
        templates = list(AllowlistTemplate.objects.filter(slug__in=DEMO_TEMPLATES))
        missing = set(DEMO_TEMPLATES) - {template.slug for template in templates}
        if missing:
            raise CommandError(f"the shipped templates {', '.join(sorted(missing))} are missing")
        with transaction.atomic():
            organisation = create_organisation("Demo", by=admin)
            agent = create_agent(organisation, "demo", by=admin, templates=templates)
            token, created = Token.objects.get_or_create(user=admin)
        url = options["url"].rstrip("/")
        body = json.dumps({"agent": agent.pk, "task": DEMO_TASK})
        key_page = url + reverse("admin:budgets_modelkey_add")
        # A token made before (by hand) is not shown again: the line asks for it.
        token_value = (
            token.key
            if created
            else '"$(.venv/bin/python manage.py drf_create_token admin | cut -d" " -f3)"'
        )
        self.stdout.write(
            f"Made the organisation Demo and its agent demo (id {agent.pk}), which runs the"
            " Claude runtime in the default workplace. In another shell in this checkout, start"
            " a run of it and follow its log"
            + (" (the token is shown this once):" if created else ":")
        )
        # An error's answer goes to stderr (and $run stays empty) rather than a traceback.
        read_id = (
            "import json, sys; answer = json.load(sys.stdin);"
            ' print(answer.get("id") or sys.exit(f"covey: {answer}"))'
        )
        # The export on a line of its own: README.md's first five minutes changes the agent
        # with it before the first run.
        self.stdout.write(f"  export COVEY_URL={shlex.quote(url)} COVEY_TOKEN={token_value}")
        self.stdout.write(
            "  run=$(curl -sS --fail-with-body"
            ' -H "Authorization: Token $COVEY_TOKEN" -H "Content-Type: application/json"'
            f' -d {shlex.quote(body)} "$COVEY_URL/api/v1/runs/" | python3 -c'
            f" {shlex.quote(read_id)}); echo $run"
        )
        self.stdout.write('  scripts/run-log "$run"')
        self.stdout.write(
            "The run needs Demo's Anthropic API key (the model gateway sends it; the agent never"
            f" holds it): enter it at {key_page}. Without one, the run fails at once saying so"
            " (README.md's first five minutes runs the demo without one)."
        )
