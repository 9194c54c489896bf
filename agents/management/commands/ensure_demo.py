"""On a new installation (no organisation yet), make a demo organisation and agent, and print
the two lines that start a run of it through the API and follow its log."""

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
        body = shlex.quote(f'{{"agent": {agent.pk}, "task": "{DEMO_TASK}"}}')
        key_page = url + reverse("admin:budgets_modelkey_add")
        token_line = (
            f"COVEY_TOKEN={token.key}"
            if created
            else "COVEY_TOKEN=<admin's API token: manage.py drf_create_token admin>"
        )
        self.stdout.write(
            f"Made the organisation Demo and its agent demo (id {agent.pk}), which runs the"
            " Claude runtime in the default workplace. Start a run and follow its log"
            + (" (the token is shown this once):" if created else ":")
        )
        self.stdout.write(
            f"  export COVEY_URL={url} {token_line}; run=$(curl -sSf"
            ' -H "Authorization: Token $COVEY_TOKEN" -H "Content-Type: application/json"'
            f' -d {body} "$COVEY_URL/api/v1/runs/"'
            " | python3 -c 'import json, sys; print(json.load(sys.stdin)[\"id\"])'); echo $run"
        )
        self.stdout.write('  scripts/run-log "$run"')
        self.stdout.write(
            "The run needs Demo's Anthropic API key (the model gateway sends it; the agent never"
            f" holds it): enter it at {key_page}. Without one, the run fails at once saying so."
        )
