"""A grant's rules per ref update: what is protected, what the agent may push to, deletes and
force-pushes, and patterns that cannot be written."""

import pytest

from connections.rules import (
    DEFAULT_PROTECTED,
    GitGrant,
    check_repository_pattern,
    default_push,
    judge,
    matching,
)
from connections.smarthttp import Command, Malformed

OLD, NEW, ZERO = "a" * 40, "b" * 40, "0" * 40
MAIN = "refs/heads/main"
GRANT = GitGrant(repositories=("acme/app",), push=default_push("builder"))


def update(ref, old=OLD, new=NEW):
    return Command(old, new, ref)


JUDGED = [
    # (grant, command, default branch, fast-forward, refused with)
    (GRANT, update("refs/heads/covey/builder/x"), MAIN, True, None),
    (GRANT, update("refs/heads/covey/builder/deep/x"), MAIN, True, None),
    (GRANT, update("refs/heads/covey/builder/x", old=ZERO), MAIN, None, None),
    (GRANT, update("refs/heads/covey/other/x"), MAIN, True, "allows pushing to covey/builder/*"),
    (GRANT, update("refs/heads/covey/builder"), MAIN, True, "allows pushing to covey/builder/*"),
    (GRANT, update("refs/heads/covey/builderx/y"), MAIN, True, "allows pushing"),
    (GRANT, update(MAIN), MAIN, True, "the default branch (HEAD) is never pushed to"),
    (GRANT, update("refs/heads/trunk"), "refs/heads/trunk", True, "the default branch (HEAD)"),
    (GRANT, update("refs/tags/v1", old=ZERO), MAIN, None, "refs/tags/* is never pushed to"),
    (GRANT, update("refs/heads/covey/builder/x", new=ZERO), MAIN, None, "deleting"),
    (GRANT, update("refs/heads/covey/builder/x"), MAIN, False, "a force-push"),
    (GRANT, update("refs/heads/covey/builder/x"), MAIN, None, "cannot tell"),
    # The default branch not known: it could be any branch, so every branch is protected.
    (GRANT, update("refs/heads/covey/builder/x"), None, True, "the default branch (HEAD)"),
    (
        GitGrant(("acme/*",), ("covey/builder/*",), force_push=True, delete=True),
        update("refs/heads/covey/builder/x"),
        MAIN,
        False,
        None,
    ),
    (
        GitGrant(("acme/*",), ("covey/builder/*",), force_push=True, delete=True),
        update("refs/heads/covey/builder/x", new=ZERO),
        MAIN,
        None,
        None,
    ),
    # Force and delete reach only what it may push to, and never what is protected.
    (
        GitGrant(("acme/*",), ("covey/builder/*",), force_push=True, delete=True),
        update(MAIN, new=ZERO),
        MAIN,
        None,
        "never pushed to",
    ),
    (
        GitGrant(("acme/*",), ("*",), protected=("HEAD", "release/*")),
        update("refs/heads/release/1"),
        MAIN,
        True,
        "release/* is never pushed to",
    ),
    (GitGrant(("acme/*",), ("*",), protected=()), update(MAIN), MAIN, True, None),
    (GitGrant(("acme/*",), ()), update("refs/heads/x"), MAIN, True, "no branch (read only)"),
    (
        GitGrant(("acme/*",), ("refs/tags/covey-*",), protected=("HEAD",)),
        update("refs/tags/covey-1", old=ZERO),
        MAIN,
        None,
        None,
    ),
    # HEAD allowed on purpose, but the default branch not known: not allowed.
    (GitGrant(("acme/*",), ("HEAD",), protected=()), update(MAIN), None, True, "allows pushing"),
    (GitGrant(("acme/*",), ("HEAD",), protected=()), update(MAIN), MAIN, True, None),
]


@pytest.mark.parametrize(("grant", "command", "default", "fast_forward", "refused"), JUDGED)
def test_each_ref_update_is_judged_by_the_grant(grant, command, default, fast_forward, refused):
    reason = judge(grant, command, default_branch=default, fast_forward=fast_forward)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None
        assert refused in reason


def test_a_grant_covers_its_repositories_ignoring_case():
    grant = GitGrant(("Acme/App", "globex/*"), default_push("builder"))
    assert grant.covers("acme/app")
    assert grant.covers("ACME/APP")
    assert grant.covers("globex/anything")
    assert not grant.covers("acme/app2")
    assert not grant.covers("acme/ap")
    assert not grant.covers("initech/app")


@pytest.mark.parametrize(
    "pattern", ["acme", "acme/", "/app", "acme/app/x", "*/app", "acme/a*", "acme/..", "ac me/x"]
)
def test_a_repository_is_owner_slash_name_or_owner_slash_star(pattern):
    with pytest.raises(Malformed, match="give owner/name, or owner/\\* for all"):
        check_repository_pattern(pattern)


@pytest.mark.parametrize(
    ("push", "says"),
    [
        (("a..b/*",), "not a name git allows"),
        (("x?",), "not a name git allows"),
        (("refs/notes/*",), "only branches"),
    ],
)
def test_a_grant_with_a_pattern_git_could_not_match_is_refused(push, says):
    with pytest.raises(Malformed, match=says):
        GitGrant(("acme/app",), push)


def test_a_star_matches_across_slashes_and_nothing_else_is_special():
    assert matching(["covey/*"], "refs/heads/covey/a/b", None, protecting=False) == "covey/*"
    assert matching(["a.b"], "refs/heads/axb", None, protecting=False) is None
    assert matching(["refs/tags/*"], "refs/heads/x", None, protecting=True) is None
    assert DEFAULT_PROTECTED == ("HEAD", "refs/tags/*")
