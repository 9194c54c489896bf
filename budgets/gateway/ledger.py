"""The model gateway's ledger in covey's database (budgets.services), for the gateway's
worker threads: each keeps its database connection; one that fails is closed, so the next
call opens a new one, and the request is refused (503)."""

from collections.abc import Iterator
from contextlib import contextmanager

from celery import current_app
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from agents.models import Agent
from budgets import services
from budgets.gateway.server import BUDGET_EXHAUSTED, Caller, Hold, Refused
from budgets.models import GatewayToken, ModelKey, Reservation, Vendor
from budgets.usage import Usage
from covey import crypto


@contextmanager
def _database() -> Iterator[None]:
    try:
        yield
    except (OperationalError, InterfaceError):
        connection.close()
        raise


class DjangoLedger:
    def authenticate(self, token: str) -> Caller:
        with _database():
            found = (
                GatewayToken.objects.select_related("agent__organisation")
                .filter(
                    sha256=services.hash_token(token),
                    revoked_at__isnull=True,
                    expires_at__gt=timezone.now(),
                )
                .first()
            )
            if found is None:
                raise Refused(
                    401,
                    "authentication_error",
                    "covey's model gateway does not know this token, or it has ended (a run's"
                    " token ends with the run)",
                )
            agent = found.agent
            name = f"{agent.organisation.slug}/{agent.slug}"
            if not agent.enabled:
                raise Refused(403, "permission_error", f"the agent {name} is disabled")
            key = ModelKey.objects.filter(
                organisation_id=agent.organisation_id, vendor=Vendor.ANTHROPIC
            ).first()
        if key is None:
            raise Refused(
                403,
                "permission_error",
                f"the organisation {agent.organisation.slug} has no Anthropic API key: an admin"
                " enters one (Budgets → Model keys)",
            )
        try:
            secret = crypto.decrypt(key.secret)
        except crypto.Undecryptable as exc:
            raise Refused(
                503, "api_error", f"the organisation's model key cannot be read ({exc})"
            ) from None
        return Caller(
            agent_id=agent.pk,
            organisation_id=agent.organisation_id,
            run_id=str(found.run_id) if found.run_id else None,
            name=name,
            key=secret,
        )

    def reserve(
        self, caller: Caller, *, model: str, input_bound: int, max_tokens: int, request_id: str
    ) -> Hold:
        with _database():
            agent = Agent(pk=caller.agent_id, organisation_id=caller.organisation_id)
            try:
                reservation = services.reserve(
                    agent,
                    model=model,
                    input_bound=input_bound,
                    max_tokens=max_tokens,
                    request_id=request_id,
                    run_id=caller.run_id,
                )
            except services.Unpriced as exc:
                raise Refused(400, "invalid_request_error", str(exc), "unpriced-model") from None
            except services.Exhausted as exc:
                if exc.first:  # its runs are stopped (runs.tasks), by name: runs is above us
                    current_app.send_task("runs.stop_over_budget", args=[agent.pk])
                raise Refused(402, "billing_error", str(exc), BUDGET_EXHAUSTED) from None
        return Hold(reservation.pk, request_id)

    def settle(self, hold: Hold, usage: Usage, *, model: str, outcome: str) -> None:
        with _database():
            services.settle(
                Reservation(pk=hold.reservation_id), usage, model=model, outcome=outcome
            )

    def release(self, hold: Hold) -> None:
        with _database():
            services.release(Reservation(pk=hold.reservation_id))
