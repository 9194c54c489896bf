"""Registering runners, their tokens (renewed at every control-plane start), pause, and the
built-in runners of the control-plane host."""

import json
import os
import secrets
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from agents.labels import normalise_labels
from egress.policy import hash_token
from organisations.models import Organisation
from runners import dispatch
from runners.host import config as host_config
from runners.models import Installation, RegistrationToken, Runner

BUILTIN_NAME = "builtin"  # with the organisation's slug: builtin_name()

# What happens when a runner may take work (resumed, heard from, trusted by a probe), from apps
# that build on this one (they register in their AppConfig.ready()): the runs app places what
# waits for the runner's organisation. Each hook takes the organisation's id.
when_available: list[Callable[[int], object]] = []


def installation_key() -> str:
    """This installation's key (made the first time it is asked for)."""
    try:
        with transaction.atomic():
            installation, _ = Installation.objects.get_or_create(pk=1)
    except IntegrityError:  # another process made it at the same moment
        installation = Installation.objects.get(pk=1)
    return installation.key


def create_registration_token(
    organisation: Organisation, *, by: Any = None, description: str = ""
) -> tuple[RegistrationToken, str]:
    """A new registration token; the secret is returned once and stored only hashed."""
    secret = "covey-reg-" + secrets.token_urlsafe(24)
    token = RegistrationToken.objects.create(
        organisation=organisation,
        description=description,
        sha256=hash_token(secret),
        prefix=secret[10:18],
        created_by=by if by is not None and by.is_authenticated else None,
    )
    return token, secret


@transaction.atomic
def register_runner(
    registration_secret: str, name: str, labels: Iterable[str]
) -> tuple[Runner, str]:
    """Exchange a registration token for a runner and its runner token (returned once)."""
    now = timezone.now()
    registration = (
        RegistrationToken.objects.select_related("organisation")
        .filter(sha256=hash_token(registration_secret), revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    if registration is None:
        raise ValidationError({"registration_token": ["unknown, revoked or expired"]})
    try:
        clean_labels = normalise_labels(list(labels))
    except ValueError as exc:
        raise ValidationError({"labels": [str(exc)]}) from None
    if Runner.objects.filter(organisation=registration.organisation, name=name).exists():
        raise ValidationError({"name": [f"a runner named {name!r} exists already"]})
    secret = new_runner_token()
    runner = Runner(
        organisation=registration.organisation,
        name=name,
        labels=clean_labels,
        token_sha256=hash_token(secret),
        token_prefix=secret[10:18],
    )
    runner.full_clean()
    runner.save()
    return runner, secret


def runner_for_token(secret: str) -> Runner | None:
    """The runner a runner token belongs to, or None."""
    if not secret:
        return None
    return (
        Runner.objects.select_related("organisation")
        .filter(token_sha256=hash_token(secret))
        .first()
    )


def new_runner_token() -> str:
    return "covey-run-" + secrets.token_urlsafe(32)


def available(runner: Runner) -> None:
    """The runner may take work now: every hook in :data:`when_available` hears of it."""
    for hook in when_available:
        hook(runner.organisation_id)


def set_paused(runner: Runner, paused: bool) -> Runner:
    """Pause (finish what runs, take nothing new) or resume; resuming places waiting runs."""
    Runner.objects.filter(pk=runner.pk).update(paused=paused)
    runner.paused = paused
    if not paused:
        available(runner)
    return runner


def heartbeat(runner: Runner, problem: str | None = None) -> None:
    """The runner is alive (its authentication marked it seen) and, when its host says,
    whether it can take work (``problem``: '' when it can); place what waits for it."""
    if problem is not None and (runner.host_ready, runner.host_problem) != (not problem, problem):
        Runner.objects.filter(pk=runner.pk).update(host_ready=not problem, host_problem=problem)
        runner.host_ready, runner.host_problem = not problem, problem
    if not runner.paused:
        available(runner)


# --- the control-plane host's own runners ----------------------------------------------------


def builtin_dir() -> Path:
    """Where the control plane leaves the built-in runners' identities for the runner host."""
    return host_config.builtin_dir(Path(settings.VAR_DIR))


def builtin_name(organisation: Organisation) -> str:
    """A built-in runner's name, 'builtin-acme': one host serves every organisation's, so
    its logs, its metrics and people tell them apart by it."""
    return f"{BUILTIN_NAME}-{organisation.slug}"[:100]  # Runner.name's max_length


def ensure_builtin_runner(organisation: Organisation) -> Runner | None:
    """The organisation's built-in runner (made when missing), or None when they are off."""
    if not settings.COVEY_BUILTIN_RUNNER:
        return None
    runner = Runner.objects.filter(organisation=organisation, builtin=True).first()
    if runner is not None:
        return runner
    name = builtin_name(organisation)
    if Runner.objects.filter(organisation=organisation, name=name).exists():
        name = f"{name[:93]}-{secrets.token_hex(3)}"
    secret = new_runner_token()
    runner = Runner.objects.create(
        organisation=organisation,
        name=name,
        builtin=True,
        token_sha256=hash_token(secret),
        token_prefix=secret[10:18],
        token_renewed_at=timezone.now(),
    )
    transaction.on_commit(lambda: write_builtin_identity(runner, secret))
    return runner


def remove_builtin_runner(organisation: Organisation) -> None:
    """An organisation is being deleted, and its built-in runner with it (the foreign key's
    on_delete): once that commits, its identity file goes, so the runner host stops serving
    it."""
    for runner_id in Runner.objects.filter(organisation=organisation, builtin=True).values_list(
        "pk", flat=True
    ):
        transaction.on_commit(
            partial((builtin_dir() / f"{runner_id}.json").unlink, missing_ok=True)
        )


def write_builtin_identity(runner: Runner, secret: str) -> None:
    """Atomically (re)write a built-in runner's identity file (mode 0600)."""
    directory = builtin_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{runner.pk}.json"
    temporary = path.with_suffix(".tmp")
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
        json.dump(
            {
                "id": runner.pk,
                "name": runner.name,
                "token": secret,
                "installation": installation_key(),
            },
            file,
        )
    temporary.replace(path)


def renew_runner_tokens() -> int:
    """Give every runner a new token (the old one stops working at once); returns how many.

    Built-in runners get theirs in their identity file; remote runners in a sealed order on
    their queue, which they read with their old token and apply without a restart.
    """
    renewed = 0
    for organisation in Organisation.objects.all():
        ensure_builtin_runner(organisation)
    for runner_id in list(Runner.objects.values_list("pk", flat=True)):
        with transaction.atomic():
            runner = Runner.objects.select_for_update().get(pk=runner_id)
            secret = new_runner_token()
            old = runner.token_sha256
            Runner.objects.filter(pk=runner.pk).update(
                token_sha256=hash_token(secret),
                token_prefix=secret[10:18],
                token_renewed_at=timezone.now(),
            )
            if runner.builtin:
                transaction.on_commit(partial(write_builtin_identity, runner, secret))
            else:
                transaction.on_commit(partial(dispatch.send_token, runner, old, secret))
            renewed += 1
    return renewed
