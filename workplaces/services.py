"""Creating and changing workplaces; the API and the admin both call these.

Every change goes through :func:`update_workplace`, which writes a new numbered
:class:`WorkplaceVersion` when (and only when) the configuration actually changed. A run records
the version it was queued at, so every agent with the same workplace version gets the same
image, packages and services.
"""

from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from covey.versions import record_version
from organisations.models import Organisation
from workplaces import config
from workplaces.models import WORKPLACE_FIELDS, Workplace, WorkplaceVersion


def workplace_config(workplace: Workplace) -> dict[str, Any]:
    """The workplace's configuration as a plain dict: what a version records and a run uses."""
    return {
        "name": workplace.name,
        "description": workplace.description,
        "image": workplace.image,
        "packages": workplace.packages,
        "services": workplace.services,
        "runtime_command": list(workplace.runtime_command),
    }


@transaction.atomic
def create_workplace(
    organisation: Organisation, name: str, image: str, *, by: Any = None, **fields: Any
) -> Workplace:
    """Create a workplace at version 1 (``fields``: description, packages, services,
    runtime_command)."""
    unknown = set(fields) - set(WORKPLACE_FIELDS)
    if unknown:
        raise TypeError(f"unknown workplace fields: {', '.join(sorted(unknown))}")
    workplace = Workplace(organisation=organisation, name=name, image=image, **fields)
    _clean(workplace)
    try:
        with transaction.atomic():
            workplace.save()
    except IntegrityError:  # made by someone else meanwhile
        raise ValidationError({"name": [f"a workplace named {name!r} exists already"]}) from None
    record_version(workplace, workplace_config(workplace), by=by)
    return workplace


@transaction.atomic
def update_workplace(
    workplace: Workplace, *, by: Any = None, reason: str = "", **changes: Any
) -> Workplace:
    """Apply changes; a new version is written if the configuration changed (``reason``: why,
    when covey changes it). The row is locked meanwhile, so concurrent changes get consecutive
    numbers."""
    unknown = set(changes) - set(WORKPLACE_FIELDS)
    if unknown:
        raise TypeError(f"cannot change {', '.join(sorted(unknown))} of a workplace")
    locked = Workplace.objects.select_for_update().get(pk=workplace.pk)
    before = workplace_config(locked)
    for field, value in changes.items():
        setattr(locked, field, value)
    _clean(locked)
    after = workplace_config(locked)
    if after != before:
        locked.version += 1
        try:
            with transaction.atomic():
                locked.save()
        except IntegrityError:
            raise ValidationError(
                {"name": [f"a workplace named {locked.name!r} exists already"]}
            ) from None
        record_version(locked, after, before=before, by=by, reason=reason)
    workplace.refresh_from_db()
    return locked


def current_version(workplace: Workplace | int) -> WorkplaceVersion:
    """Its newest version, from the database (not from ``workplace``, which may be stale: a
    version made since, by an approval, is the current one)."""
    pk = workplace if isinstance(workplace, int) else workplace.pk
    return WorkplaceVersion.objects.filter(workplace_id=pk).latest("number")


def _clean(workplace: Workplace) -> None:
    """Normalise and check; ValidationError with a message per field."""
    errors: dict[str, list[str]] = {}
    for field, check in (("packages", config.check_packages), ("services", config.check_services)):
        try:
            setattr(workplace, field, check(getattr(workplace, field)))
        except ValueError as exc:
            errors[field] = [str(exc)]
    try:
        workplace.runtime_command = config.check_command(
            workplace.runtime_command, "the runtime command", empty=True
        )
    except ValueError as exc:
        errors["runtime_command"] = [f"{exc} (empty: the Claude runtime on the task)"]
    others = Workplace.objects.filter(organisation_id=workplace.organisation_id).exclude(
        pk=workplace.pk
    )
    if others.filter(name=workplace.name).exists():
        errors["name"] = [f"a workplace named {workplace.name!r} exists already"]
    try:
        workplace.full_clean(validate_unique=False, exclude=list(errors))
    except ValidationError as exc:
        errors.update(exc.message_dict)
    if errors:
        raise ValidationError(errors)
