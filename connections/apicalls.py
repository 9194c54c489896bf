"""What a grant lets an agent call on a git host's HTTP API, decided per request: the path is
read strictly (:func:`route`), then its method and path must be one of the calls the grant
names (:data:`CALLS`), on a repository the grant covers. The rules follow GitHub's REST API
(``/repos/{owner}/{name}/…``), which GitHub Enterprise Server and Gitea share. No Django.

What is never allowed, whatever the grant: merging a pull request (it would move a protected
branch without a push the gateway judges), reviews (an approval could satisfy a branch
protection meant for people), and anything outside the repository (the account, other
repositories, the installation).
"""

import re
from dataclasses import dataclass
from urllib.parse import unquote

from connections.smarthttp import Malformed, check_host, check_segment

# The calls a grant names (connections.grants.API_CALLS says them in words): method and the
# path under /repos/{owner}/{name}, as a regular expression.
# (Not statuses or check runs: they need permissions of a GitHub App's beyond those
# docs/credentials.md sets up, and a token asking for those is refused whole.)
_READ = "contents|readme|branches|commits|compare|git|tags|releases|pulls|issues|languages|topics"
CALLS: dict[str, tuple[tuple[str, str], ...]] = {
    "read": (("GET", rf"(/({_READ})(/.*)?)?"),),
    "pulls": (("POST", r"/pulls"), ("PATCH", r"/pulls/[0-9]+")),
    "comments": (
        ("POST", r"/issues/[0-9]+/comments"),
        ("PATCH", r"/issues/comments/[0-9]+"),
        ("POST", r"/pulls/[0-9]+/comments"),
        ("PATCH", r"/pulls/comments/[0-9]+"),
    ),
    "issues": (("POST", r"/issues"), ("PATCH", r"/issues/[0-9]+")),
}
_COMPILED = {
    name: tuple((method, re.compile(pattern)) for method, pattern in calls)
    for name, calls in CALLS.items()
}
# Percent-encodings no path of covey's routes needs: of a dot, a backslash, NUL, a semicolon
# (path parameters: some servers read `..;` as `..`) and of '%' itself (a second decoding).
_ENCODED = re.compile(r"%(2e|5c|00|3b|25)", re.IGNORECASE)
_SLASH = re.compile(r"%2f", re.IGNORECASE)
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


@dataclass(frozen=True)
class Call:
    """A request for an API call: ``/api/<host>/repos/<owner>/<name>[/<rest>]``."""

    host: str  # the API's host name, with ``:port`` when not 443
    owner: str
    name: str
    rest: str  # the path after the repository ("" or "/pulls", …), as sent

    @property
    def repository(self) -> str:
        return f"{self.owner}/{self.name}"

    @property
    def path(self) -> str:
        """The path at the API's root."""
        return f"/repos/{self.owner}/{self.name}{self.rest}"


def check_path(path: str, *, encoded_slash: bool = False) -> str:
    """The path (raw, as sent) decoded, or Malformed for one that could climb or hide once the
    upstream reads it, raw or decoded: a segment that is ``.`` or ``..`` or starts with a dot
    and holds a ``;``, an empty segment but the last, a backslash or a ``;`` anywhere, a
    percent-encoding of a dot, a backslash, NUL, ``;`` or ``%``, a bare ``%``, and (unless
    ``encoded_slash``: an npm package's name is ``@scope%2fname``) an encoded slash."""
    if (
        "\\" in path
        or ";" in path
        or _ENCODED.search(path)
        or _PERCENT.search(path)
        or (not encoded_slash and _SLASH.search(path))
    ):
        raise Malformed(
            "a path has no backslash, no ';', no bare '%' and no encoded '.', '\\', NUL, ';', '%'"
            + ("" if encoded_slash else " or '/'")
        )
    decoded = unquote(path)
    for form in (path, decoded):
        parts = form.split("/")
        if any(part in (".", "..") for part in parts) or "" in parts[1:-1]:
            raise Malformed("a path has no '.' or '..' segment, and no empty one but the last")
    return decoded


def route(path: str) -> Call:
    """The route of a request for ``path`` (raw, as sent). Malformed for a path that is not
    ``/api/<host>/repos/<owner>/<name>…`` or that :func:`check_path` refuses."""
    check_path(path)
    if path.endswith("/"):
        raise Malformed("an API path does not end in '/'")
    parts = path.split("/")
    if len(parts) < 6 or parts[:2] != ["", "api"] or parts[3] != "repos":
        raise Malformed("covey's API route serves /api/<host>/repos/<owner>/<name>/… only")
    host, owner, name = parts[2], parts[4], parts[5]
    check_host(host)
    check_segment("owner", owner)
    check_segment("repository name", name)
    rest = "/".join(parts[6:])
    return Call(host, owner, name, f"/{rest}" if rest else "")


def refusal(calls: frozenset[str], method: str, call: Call) -> str | None:
    """Why the grant's ``calls`` do not allow ``method`` on ``call`` (the rule, in words),
    or None when one does."""
    for name in calls:
        for allowed, pattern in _COMPILED.get(name, ()):
            if allowed == method and pattern.fullmatch(call.rest):
                return None
    granted = ", ".join(sorted(calls)) or "none"
    return (
        f"{method} {call.path} is no call the grant allows"
        f" (it allows: {granted}; merging and reviews never)"
    )
