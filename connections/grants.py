"""An agent's grants as they are written (a JSON list on the agent, versioned with it) and
checked: :func:`check_grants` fills in the defaults and refuses, naming the grant and the key,
what is not a grant. No Django: the connections a grant may name are given.

A grant over a git host's connection (a GitHub App or a token)::

    {"connection": "github", "repositories": ["acme/app"], "push": ["covey/<agent>/*"],
     "protected": ["HEAD", "refs/tags/*"], "force_push": false, "delete": false,
     "api": ["read", "pulls", "comments"]}

(``push``, ``protected``, the flags and ``api`` may be left out: those are the defaults). A
grant over a registry's connection (user name and password) is ``{"connection": "pypi"}``: the
connection's own paths say what it is for, and registries are read only.
"""

from collections.abc import Mapping
from typing import Any

from connections.rules import DEFAULT_PROTECTED, GitGrant, default_push
from connections.smarthttp import Malformed

# The API calls a grant may allow, on its repositories only (the gateway's rules per name).
API_CALLS = {
    "read": "read the repository: its contents, branches, commits, pull requests and issues",
    "pulls": "open pull requests and change their title, body, base and state",
    "comments": "comment on pull requests and issues, and review pull requests",
    "issues": "open issues and change them",
}
DEFAULT_API = ("read", "pulls", "comments")
GIT_KINDS = frozenset({"github-app", "token"})  # the kinds whose grants name repositories
GIT_KEYS = ("connection", "repositories", "push", "protected", "force_push", "delete", "api")
EXAMPLE = '[{"connection": "github", "repositories": ["acme/app"]}]'


def check_grants(value: Any, *, agent: str, connections: Mapping[str, str]) -> list[dict[str, Any]]:
    """``value`` as grants in full (defaults filled in), for an agent whose slug is ``agent``,
    naming only ``connections`` (name → kind). ValueError naming the grant and what is wrong."""
    if not isinstance(value, list):
        raise ValueError(f"grants are a JSON list, e.g. {EXAMPLE}")
    grants: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, item in enumerate(value, 1):
        try:
            grant = _grant(item, agent, connections)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"grant {number}: {exc}") from None
        if grant["connection"] in seen:
            raise ValueError(
                f"grant {number}: connection {grant['connection']!r} is granted twice;"
                " put what it allows in one grant"
            )
        seen.add(grant["connection"])
        grants.append(grant)
    return grants


def _grant(item: Any, agent: str, connections: Mapping[str, str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ValueError('a grant is an object, e.g. {"connection": "github", ...}')
    name = item.get("connection")
    if not isinstance(name, str) or not name:
        raise ValueError("give the connection it is over, by name")
    kind = connections.get(name)
    if kind is None:
        known = ", ".join(sorted(connections)) or "none yet"
        raise ValueError(f"no connection named {name!r} in this organisation (it has: {known})")
    if kind not in GIT_KINDS:
        if set(item) != {"connection"}:
            raise ValueError(
                f"connection {name!r} is a registry's: its grant names the connection only"
                " (its paths are the connection's, and it is read only)"
            )
        return {"connection": name}
    unknown = set(item) - set(GIT_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; a grant has {', '.join(GIT_KEYS)}")
    repositories = _texts(item, "repositories", None)
    if not repositories:
        raise ValueError("name the repositories it may use: owner/name, or owner/* for all")
    api = _texts(item, "api", DEFAULT_API)
    for call in api:
        if call not in API_CALLS:
            raise ValueError(f"api: {call!r} is none of {', '.join(API_CALLS)}")
    grant = {
        "connection": name,
        "repositories": repositories,
        "push": _texts(item, "push", default_push(agent)),
        "protected": _texts(item, "protected", DEFAULT_PROTECTED),
        "force_push": _flag(item, "force_push"),
        "delete": _flag(item, "delete"),
        "api": api,
    }
    try:
        git_grant(grant)
    except Malformed as exc:
        raise ValueError(str(exc)) from None
    return grant


def git_grant(grant: Mapping[str, Any]) -> GitGrant:
    """The rules of a checked grant over a git host."""
    return GitGrant(
        repositories=tuple(grant["repositories"]),
        push=tuple(grant["push"]),
        protected=tuple(grant["protected"]),
        force_push=grant["force_push"],
        delete=grant["delete"],
    )


def _texts(item: Mapping[str, Any], key: str, default: tuple[str, ...] | None) -> list[str]:
    value = item.get(key, default)
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}: a list of texts")
    return list(dict.fromkeys(value))


def _flag(item: Mapping[str, Any], key: str) -> bool:
    value = item.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: true or false")
    return value
