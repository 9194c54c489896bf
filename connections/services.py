"""Making, changing and rotating connections; the API and the admin both call these.

Each kind has its fields (:data:`FIELDS`); a field another kind uses is refused rather than
kept unused, so what a connection says is what the gateway does. A credential is checked for
its form (a GitHub App's key must be an RSA private key in PEM; a token or password one line of
printable text) and encrypted before it is saved; it is never returned. Every change is on the
connection's history, with who made it; a rotation shows there as a new ``secret_set_at``.
"""

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from connections.models import CONNECTION_FIELDS, Connection, Kind, Scheme
from covey.crypto import encrypt
from organisations.models import Organisation

MAX_SECRET = 16 * 1024
GITHUB = {"git_url": "https://github.com", "api_url": "https://api.github.com"}
# The fields each kind uses (besides name and the credential); every other one must be empty.
FIELDS = {
    Kind.GITHUB_APP: ("git_url", "api_url", "app_id", "installation_id"),
    Kind.TOKEN: ("git_url", "api_url", "scheme", "username", "header"),
    Kind.BASIC: ("index_url", "username", "paths"),
}
CHANGEABLE = frozenset(CONNECTION_FIELDS) - {"organisation", "kind"}  # neither ever changes
FORBIDDEN_HEADERS = frozenset(
    {"host", "cookie", "connection", "content-length", "transfer-encoding", "proxy-authorization"}
)


@transaction.atomic
def create_connection(
    organisation: Organisation, name: str, kind: str, secret: str, *, by: Any = None, **fields: Any
) -> Connection:
    """A new connection with its credential (``fields``: what its kind uses)."""
    unknown = set(fields) - CHANGEABLE
    if unknown:
        raise TypeError(f"unknown connection fields: {', '.join(sorted(unknown))}")
    connection = with_defaults(
        Connection(organisation=organisation, name=name, kind=kind, **fields)
    )
    errors = problems(connection, secret)
    if errors:
        raise ValidationError(errors)
    connection.secret = encrypt(secret)
    connection.secret_set_at = timezone.now()
    connection._history_user = by  # type: ignore[attr-defined]
    _save(connection)
    return connection


@transaction.atomic
def update_connection(connection: Connection, *, by: Any = None, **changes: Any) -> Connection:
    """Change what a connection says (not its kind, not its credential: rotate that)."""
    unknown = set(changes) - CHANGEABLE
    if unknown:
        raise TypeError(f"cannot change {', '.join(sorted(unknown))} of a connection")
    locked = Connection.objects.select_for_update().get(pk=connection.pk)
    for field, value in changes.items():
        setattr(locked, field, value)
    errors = _errors(locked)
    if errors:
        raise ValidationError(errors)
    locked._history_user = by  # type: ignore[attr-defined]
    _save(locked)
    connection.refresh_from_db()
    return locked


@transaction.atomic
def rotate_secret(connection: Connection, secret: str, *, by: Any = None) -> Connection:
    """Put a new credential in the old one's place: the next request the gateway makes with
    the connection uses it. What the upstream said of the old one is forgotten."""
    locked = Connection.objects.select_for_update().get(pk=connection.pk)
    try:
        _check_secret(locked.kind, secret)
    except ValueError as exc:
        raise ValidationError({"secret": [str(exc)]}) from None
    locked.secret = encrypt(secret)
    locked.secret_set_at = timezone.now()
    locked.status, locked.status_at = "", None
    locked._history_user = by  # type: ignore[attr-defined]
    locked.save()
    connection.refresh_from_db()
    return locked


@transaction.atomic
def delete_connection(connection: Connection, *, by: Any = None) -> None:
    """Delete a connection no agent's grant names (its history stays)."""
    locked = Connection.objects.select_for_update().get(pk=connection.pk)
    if users := granted_to(locked):
        raise ValidationError(
            {"name": [f"agents' grants name it ({', '.join(users)}): remove those first"]}
        )
    locked._history_user = by  # type: ignore[attr-defined]
    locked.delete()


def granted_to(connection: Connection, *, name: str | None = None) -> list[str]:
    """The agents (by slug) whose grants name the connection (by ``name``: its own)."""
    name = name or connection.name
    agents = connection.organisation.agents.only("slug", "credential_grants")
    return [
        agent.slug
        for agent in agents
        if any(grant.get("connection") == name for grant in agent.credential_grants)
    ]


def granted(organisation_id: int, grants: Iterable[Mapping[str, Any]]) -> list[Connection]:
    """The connections that ``grants`` (an agent's) name, in their order."""
    names = [grant.get("connection") for grant in grants]
    found = {
        c.name: c
        for c in Connection.objects.filter(organisation_id=organisation_id, name__in=names)
    }
    return [found[name] for name in names if name in found]


def kinds_of(organisation_id: int) -> dict[str, str]:
    """The organisation's connections: name → kind (what grants may name)."""
    rows = Connection.objects.filter(organisation_id=organisation_id).values_list("name", "kind")
    return dict(rows)


def with_defaults(connection: Connection) -> Connection:
    """``connection`` with what its kind assumes when it is not said: github.com's URLs for a
    GitHub App, a bearer token, a registry's whole root."""
    if connection.kind == Kind.GITHUB_APP:
        for field, default in GITHUB.items():
            setattr(connection, field, getattr(connection, field) or default)
    if connection.kind == Kind.TOKEN and not connection.scheme:
        connection.scheme = Scheme.BEARER
    if connection.kind == Kind.BASIC and not connection.paths:
        connection.paths = ["/"]
    return connection


def problems(connection: Connection, secret: str | None) -> dict[str, list[str]]:
    """What is wrong with ``connection`` (and ``secret``, unless None: kept), per field."""
    errors = _errors(connection)
    if secret is not None:
        try:
            _check_secret(connection.kind, secret)
        except ValueError as exc:
            errors["secret"] = [str(exc)]
    return errors


def _save(connection: Connection) -> None:
    try:
        with transaction.atomic():
            connection.save()
    except IntegrityError:  # made by someone else meanwhile
        raise ValidationError(
            {"name": [f"a connection named {connection.name!r} exists already"]}
        ) from None


def _errors(connection: Connection) -> dict[str, list[str]]:
    """What is wrong with the connection's fields, per field."""
    errors: dict[str, list[str]] = {}
    try:
        connection.full_clean(
            exclude=["secret", "secret_set_at"], validate_unique=False, validate_constraints=False
        )
    except ValidationError as exc:
        errors.update(exc.message_dict)
    if "kind" in errors:
        return errors
    kind = Kind(connection.kind)
    used = FIELDS[kind]
    for field in CHANGEABLE - {"name"} - set(used):
        if getattr(connection, field):
            label = getattr(Connection._meta.get_field(field), "verbose_name", field)
            errors.setdefault(field, []).append(
                f"a {kind.label} connection has no {label}: leave it empty"
            )
    for field in ("git_url", "api_url", "index_url"):
        value = getattr(connection, field)
        if value and field not in errors and (problem := _url_problem(value)):
            errors[field] = [problem]
    errors.update(_kind_errors(kind, connection))
    others = Connection.objects.filter(organisation_id=connection.organisation_id)
    if others.exclude(pk=connection.pk).filter(name=connection.name).exists():
        errors["name"] = [f"a connection named {connection.name!r} exists already"]
    stored = others.filter(pk=connection.pk).values_list("name", flat=True).first()
    if stored not in (None, connection.name) and (users := granted_to(connection, name=stored)):
        errors["name"] = [f"agents' grants name it ({', '.join(users)}): change those first"]
    return errors


def _kind_errors(kind: Kind, connection: Connection) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    if kind == Kind.GITHUB_APP:
        for field in ("app_id", "installation_id"):
            if not getattr(connection, field).isdigit():
                errors[field] = ["the number GitHub shows for it"]
    elif kind == Kind.TOKEN:
        if not (connection.git_url or connection.api_url):
            errors["git_url"] = ["give its git URL, its API URL, or both"]
        if connection.scheme == Scheme.BASIC and not connection.username:
            errors["username"] = ["basic authentication sends a user name with the token"]
        if connection.scheme != Scheme.BASIC and connection.username:
            errors["username"] = ["only the basic scheme sends a user name"]
        if connection.scheme == Scheme.HEADER:
            header = connection.header
            if not header.replace("-", "").isalnum() or header.lower() in FORBIDDEN_HEADERS:
                errors["header"] = ["a header name of letters, digits and '-', e.g. PRIVATE-TOKEN"]
        elif connection.header:
            errors["header"] = ["only the header scheme sends the token in a header of its own"]
    else:
        if not connection.index_url:
            errors["index_url"] = ["give the registry's or the API's root"]
        if not connection.username:
            errors["username"] = ["basic authentication sends a user name"]
        paths = connection.paths
        if not (
            isinstance(paths, list)
            and paths
            and all(isinstance(p, str) and p.startswith("/") and ".." not in p for p in paths)
        ):
            errors["paths"] = ['a list of paths that start with "/", e.g. ["/simple/"]']
    if ":" in connection.username or not connection.username.isprintable():
        errors["username"] = ["basic authentication's user name has no ':' and is printable"]
    return errors


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme != "https":
        return "https only: the credential travels with every request"
    if parts.username or parts.password:
        return "no user name or password in the URL: the credential is kept apart"
    if parts.query or parts.fragment:
        return "no query or fragment: give the root"
    try:
        parts.port  # noqa: B018 - read to be checked
    except ValueError:
        return "the port is a number from 1 to 65535"
    if not parts.hostname:
        return "give the host, e.g. https://git.example.com"
    return None


def _check_secret(kind: str, secret: str) -> None:
    """ValueError saying what the credential should look like."""
    if not isinstance(secret, str) or not secret.strip():
        raise ValueError("give the credential")
    if len(secret) > MAX_SECRET:
        raise ValueError(f"at most {MAX_SECRET} characters")
    if kind == Kind.GITHUB_APP:
        try:
            key = load_pem_private_key(secret.strip().encode(), password=None)
        except (ValueError, TypeError):
            raise ValueError(
                "the app's private key, in PEM, as GitHub gave it (-----BEGIN RSA PRIVATE KEY-----)"
            ) from None
        if not isinstance(key, RSAPrivateKey):
            raise ValueError("a GitHub App's key is an RSA key")
    elif not secret.isprintable() or any(c.isspace() for c in secret):
        raise ValueError("one line of printable text, with no spaces")
