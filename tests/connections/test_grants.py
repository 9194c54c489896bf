"""Grants as written on an agent: defaults filled in, and what is not a grant refused with the
grant's number and what is wrong."""

import pytest

from connections.grants import check_grants

CONNECTIONS = {"github": "github-app", "gitlab": "token", "pypi": "basic"}


def check(value):
    return check_grants(value, agent="builder", connections=CONNECTIONS)


def test_a_grant_gets_the_defaults():
    assert check([{"connection": "github", "repositories": ["acme/app", "acme/app"]}]) == [
        {
            "connection": "github",
            "repositories": ["acme/app"],
            "push": ["covey/builder/*"],
            "protected": ["HEAD", "refs/tags/*"],
            "force_push": False,
            "delete": False,
            "api": ["read", "pulls", "comments"],
        }
    ]


def test_what_a_grant_says_is_kept():
    grant = {
        "connection": "gitlab",
        "repositories": ["acme/*"],
        "push": ["feature/*"],
        "protected": [],
        "force_push": True,
        "delete": True,
        "api": [],
    }
    assert check([grant]) == [grant]
    assert check([{"connection": "pypi"}]) == [{"connection": "pypi"}]
    assert check([]) == []


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"connection": "github"}, "grants are a JSON list"),
        (["github"], "grant 1: a grant is an object"),
        ([{"repositories": ["acme/app"]}], "grant 1: give the connection"),
        ([{"connection": "nope", "repositories": ["a/b"]}], "no connection named 'nope'"),
        ([{"connection": "github"}], "name the repositories"),
        ([{"connection": "github", "repositories": []}], "name the repositories"),
        ([{"connection": "github", "repositories": "acme/app"}], "repositories: a list of texts"),
        ([{"connection": "github", "repositories": ["acme"]}], "give owner/name"),
        ([{"connection": "github", "repositories": ["*/*"]}], "give owner/name"),
        ([{"connection": "github", "repositories": ["a/b"], "push": ["a..b"]}], "git allows"),
        ([{"connection": "github", "repositories": ["a/b"], "force_push": "yes"}], "true or"),
        ([{"connection": "github", "repositories": ["a/b"], "api": ["admin"]}], "'admin' is none"),
        ([{"connection": "github", "repositories": ["a/b"], "token": "x"}], "unknown keys"),
        ([{"connection": "pypi", "repositories": ["a/b"]}], "names the connection only"),
        (
            [
                {"connection": "github", "repositories": ["a/b"]},
                {"connection": "github", "repositories": ["a/c"]},
            ],
            "grant 2: connection 'github' is granted twice",
        ),
    ],
)
def test_what_is_not_a_grant_is_refused_saying_which_and_why(value, says):
    with pytest.raises(ValueError, match=says.replace("*", r"\*")):
        check(value)


def test_a_refusal_lists_the_connections_there_are():
    with pytest.raises(ValueError, match="it has: github, gitlab, pypi"):
        check([{"connection": "github-enterprise", "repositories": ["a/b"]}])
    with pytest.raises(ValueError, match="it has: none yet"):
        check_grants([{"connection": "x"}], agent="builder", connections={})
