"""What a grant lets an agent do with a git repository, decided per ref update (:func:`judge`).

A grant names repositories (``owner/name``, or ``owner/*`` for every repository of an owner),
the branches the agent may push to (patterns; by default ``covey/<agent>/*``), the refs it may
never push to (by default ``HEAD``, the repository's default branch, and ``refs/tags/*``), and
whether it may force-push to or delete the branches it may push to. A pattern is a branch name,
or a full ref when it starts with ``refs/``; ``*`` stands for any run of characters, ``/``
included. Protected wins over allowed. No Django: the gateway judges with it.
"""

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from connections.smarthttp import Command, Malformed, check_ref_name

DEFAULT_BRANCH = "HEAD"  # in a protected list: the repository's default branch
DEFAULT_PROTECTED = (DEFAULT_BRANCH, "refs/tags/*")
_OWNER_OR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def default_push(agent: str) -> tuple[str, ...]:
    """The branches an agent named ``agent`` (its slug) may push to unless its grant says."""
    return (f"covey/{agent}/*",)


def check_repository_pattern(pattern: str) -> None:
    """Malformed unless ``pattern`` is ``owner/name`` or ``owner/*``."""
    owner, slash, name = pattern.partition("/")
    if (
        not slash
        or not _OWNER_OR_NAME.fullmatch(owner)
        or not (name == "*" or _OWNER_OR_NAME.fullmatch(name))
        or ".." in pattern
    ):
        raise Malformed(f"repository {pattern[:100]!r}: give owner/name, or owner/* for all")


def check_ref_pattern(pattern: str) -> None:
    """Malformed unless ``pattern`` is ``HEAD`` or a branch or ref pattern that names refs git
    allows (with ``*`` standing for any run of characters)."""
    if pattern == DEFAULT_BRANCH:
        return
    try:
        check_ref_name(_full(pattern).replace("*", "x"))
    except Malformed as exc:
        raise Malformed(f"pattern {pattern[:100]!r}: {exc}") from None


def _full(pattern: str) -> str:
    return pattern if pattern.startswith("refs/") else f"refs/heads/{pattern}"


@functools.lru_cache(maxsize=1024)
def _expression(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(piece) for piece in _full(pattern).split("*")))


def matching(
    patterns: Iterable[str], ref: str, default_branch: str | None, *, protecting: bool
) -> str | None:
    """The first of ``patterns`` that ``ref`` matches. ``HEAD`` is ``default_branch`` (a full
    ref); when that is not known it matches every branch in a protected list and none in an
    allowed one: what cannot be placed fails closed."""
    for pattern in patterns:
        if pattern == DEFAULT_BRANCH:
            if default_branch is None:
                if protecting and ref.startswith("refs/heads/"):
                    return pattern
            elif ref == default_branch:
                return pattern
        elif _expression(pattern).fullmatch(ref):
            return pattern
    return None


@dataclass(frozen=True)
class GitGrant:
    """An agent's grant over some repositories of one connection."""

    repositories: tuple[str, ...]
    push: tuple[str, ...]  # branch or ref patterns it may push to (none: read only)
    protected: tuple[str, ...] = DEFAULT_PROTECTED
    force_push: bool = False  # rewrite history on a branch it may push to
    delete: bool = False  # delete a branch it may push to

    def __post_init__(self) -> None:
        for repository in self.repositories:
            check_repository_pattern(repository)
        for pattern in (*self.push, *self.protected):
            check_ref_pattern(pattern)

    def covers(self, repository: str) -> bool:
        """Whether ``repository`` (``owner/name``) is granted; names match ignoring case, as
        the big git hosts treat them."""
        return self.spelled(repository) is not None

    def spelled(self, repository: str) -> str | None:
        """``repository`` as the grant spells it (an exact grant's spelling; with ``owner/*``,
        the grant's owner and the name as asked), or None when it is not granted: what goes
        upstream, so that a host that minds case gets the repository granted, not another."""
        owner, _, name = repository.partition("/")
        for granted in self.repositories:
            granted_owner, _, granted_name = granted.partition("/")
            if granted_owner.lower() != owner.lower():
                continue
            if granted_name == "*":
                return f"{granted_owner}/{name}"
            if granted_name.lower() == name.lower():
                return granted
        return None


def judge(
    grant: GitGrant,
    command: Command,
    *,
    default_branch: str | None,
    fast_forward: bool | None,
) -> str | None:
    """Why ``command`` is refused under ``grant`` (the rule, in words ``git push`` prints), or
    None when it is allowed. ``default_branch`` is the repository's (``refs/heads/main``; None:
    not known, so every branch counts as it); ``fast_forward`` is whether ``command.new``
    descends from ``command.old`` (None: not known, which is not a fast-forward)."""
    rule = matching(grant.protected, command.ref, default_branch, protecting=True)
    if rule is not None:
        shown = "the default branch (HEAD)" if rule == DEFAULT_BRANCH else rule
        return f"protected by covey: {shown} is never pushed to by an agent"
    if matching(grant.push, command.ref, default_branch, protecting=False) is None:
        allowed = ", ".join(grant.push) or "no branch (read only)"
        return f"refused by covey: the grant allows pushing to {allowed}"
    if command.deletes and not grant.delete:
        return "refused by covey: the grant does not allow deleting a branch"
    if command.creates or command.deletes or grant.force_push or fast_forward:
        return None
    if fast_forward is None:
        return (
            "refused by covey: it cannot tell this is a fast-forward and the grant does not"
            " allow force-pushing (fetch, rebase and push again)"
        )
    return "refused by covey: a force-push, which the grant does not allow"
