"""The API route's reading of a path and its rules per call, on their own."""

import pytest

from connections.apicalls import CALLS, Call, check_path, refusal, route
from connections.grants import API_CALLS
from connections.registry import under
from connections.smarthttp import Malformed

DEFAULT = frozenset({"read", "pulls", "comments"})


def test_a_path_names_host_repository_and_the_rest():
    assert route("/api/api.github.com/repos/acme/app/pulls/3") == Call(
        "api.github.com", "acme", "app", "/pulls/3"
    )
    assert route("/api/ghe.acme.test:8443/repos/acme/app").rest == ""
    assert (
        route("/api/h.test/repos/acme/app/contents/docs/a%20b.md").rest == "/contents/docs/a%20b.md"
    )


@pytest.mark.parametrize(
    "path",
    [
        "/api/h.test/repos/acme/app/../secret",
        "/api/h.test/repos/acme/./app",
        "/api/h.test/repos/acme/%2E%2E/secret",
        "/api/h.test/repos/acme/app/contents/a%2fb",
        "/api/h.test/repos/acme/app/contents/..;/x",
        "/api/h.test/repos/acme/app;x/pulls",
        "/api/h.test/repos/acme/app/contents/a%252e%252e",
        "/api/h.test/repos/acme/app/contents/%3b",
        "/api/h.test/repos/acme/app/contents/a%5Cb",
        "/api/h.test/repos/acme/app/contents/a%00",
        "/api/h.test/repos/acme/app/contents/100%",
        "/api/h.test/repos/acme/app/contents/a\\b",
        "/api/h.test/repos/acme/app//pulls",
        "/api/h.test/repos/acme/app/",
        "/api/h.test/repos/acme",
        "/api/h.test/user/repos",
        "/api/h.test/app/installations",
        "/api/H.test/repos/acme/app",
        "/api/h.test:99999/repos/acme/app",
        "/api/h.test/repos/ac%6De/app",
        "/api/h.test/repos/acme/app name",
        "/git/h.test/repos/acme/app",
    ],
)
def test_a_path_that_could_climb_hide_or_leave_the_repository_is_refused(path):
    with pytest.raises(Malformed):
        route(path)


@pytest.mark.parametrize(
    ("calls", "method", "rest", "allowed"),
    [
        (DEFAULT, "GET", "", True),
        (DEFAULT, "GET", "/pulls", True),
        (DEFAULT, "GET", "/contents/src/main.py", True),
        (DEFAULT, "GET", "/actions/secrets", False),
        (DEFAULT, "GET", "/collaborators", False),
        (DEFAULT, "POST", "/pulls", True),
        (DEFAULT, "PATCH", "/pulls/12", True),
        (DEFAULT, "PUT", "/pulls/12/merge", False),
        (DEFAULT, "POST", "/pulls/12/reviews", False),
        (DEFAULT, "POST", "/merges", False),
        (DEFAULT, "POST", "/issues/12/comments", True),
        (DEFAULT, "PATCH", "/issues/comments/7", True),
        (DEFAULT, "POST", "/issues", False),
        (DEFAULT | {"issues"}, "POST", "/issues", True),
        (DEFAULT, "DELETE", "", False),
        (DEFAULT, "PATCH", "", False),
        (frozenset({"read"}), "POST", "/pulls", False),
        (frozenset(), "GET", "", False),
    ],
)
def test_a_call_passes_only_when_a_named_call_allows_its_method_and_path(
    calls, method, rest, allowed
):
    said = refusal(calls, method, Call("h.test", "acme", "app", rest))
    assert (said is None) == allowed
    if said:
        assert said.startswith(f"{method} /repos/acme/app{rest} is no call the grant allows")


def test_every_call_a_grant_may_name_has_rules():
    assert set(CALLS) == set(API_CALLS)


@pytest.mark.parametrize(
    ("path", "decoded"),
    [
        ("/registry/npm/@acme%2fwidget", "/registry/npm/@acme/widget"),
        ("/registry/pypi/simple/covey-demo/", "/registry/pypi/simple/covey-demo/"),
    ],
)
def test_a_registry_path_may_hold_an_encoded_slash_and_is_read_decoded(path, decoded):
    assert check_path(path, encoded_slash=True) == decoded


@pytest.mark.parametrize(
    "path",
    [
        "/registry/x/packages%2f..%2fadmin",  # a '..' once decoded
        "/registry/x/simple/..;/..;/other",
        "/registry/x/simple/%2e%2e/other",
        "/registry/x/simple/%252f",
    ],
)
def test_a_registry_path_that_climbs_once_decoded_is_refused(path):
    with pytest.raises(Malformed):
        check_path(path, encoded_slash=True)


def test_a_registry_s_paths_are_matched_segment_by_segment():
    assert under("/packages/acme/a.whl", "/packages/acme")
    assert under("/packages/acme", "/packages/acme")
    assert not under("/packages/acme-private/a.whl", "/packages/acme")
    assert under("/simple/x/", "/simple/") and not under("/simplex/", "/simple/")
