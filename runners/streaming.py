"""The policy stream's database (egress/stream/): the policy as egress reads it, and who may
follow it: runners, by their tokens, whose proxies are marked seen while they follow."""

from collections.abc import Collection
from typing import Any

from django.db import connection
from django.utils import timezone

from egress.sources import DatabaseStore, brief_transaction
from egress.stream.hub import Runner as Follower
from runners.models import Runner
from runners.services import runner_for_token


def psycopg_params() -> dict[str, Any]:
    """The database connection's settings as psycopg takes them, for a connection of the
    stream's own (without Django's cursor class and adapters, which are not async)."""
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(django_only, None)
    return params


class RunnersStore(DatabaseStore):
    """egress.stream.hub.Store over the database."""

    def runner(self, token: str) -> Follower | None:
        with brief_transaction():
            runner = runner_for_token(token)
        if runner is None:
            return None
        return Follower(runner.organisation_id, runner.token_sha256, runner.name)

    def touch(self, token_hashes: Collection[str]) -> set[str]:
        with brief_transaction():
            runners = Runner.objects.filter(token_sha256__in=list(token_hashes))
            valid = set(runners.values_list("token_sha256", flat=True))
            runners.update(proxy_seen_at=timezone.now())  # as its polls did (runners.auth.seen)
        return valid
