"""A stand-in of GitHub's API for the tests (served over TLS with a test CA): it mints
installation tokens only to a JSON Web Token signed with the app's key, as GitHub does, and
a git host beside it (tests/connections/githost.py) takes the tokens it minted."""

import base64
from datetime import UTC, datetime, timedelta

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa


class GitHub:
    """Installation 34 of app 12, on the account acme, with the repositories it lists."""

    def __init__(self, key: rsa.RSAPrivateKey, tokens: list[str] | None = None) -> None:
        self.key = key  # the app's (GitHub keeps only the public half)
        self.public = key.public_key()
        self.repositories = {"app", "docs"}
        self.minted: list[dict] = []
        self.asked = 0  # requests for a token, minted or not
        self.tokens = [] if tokens is None else tokens  # each token minted (a git host's list)
        self.also: set[str] = set()  # tokens its REST API takes besides the minted ones
        self.pulls: list[dict] = []
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers

    def routes(self, app: web.Application) -> None:
        """Its API on ``app``: tokens, a repository, and its pull requests."""
        app.router.add_post("/app/installations/{installation}/access_tokens", self.access_tokens)
        app.router.add_get("/repos/{owner}/{name}", self.repository)
        app.router.add_post("/repos/{owner}/{name}/pulls", self.open_pull)
        app.router.add_get("/repos/{owner}/{name}/pulls", self.list_pulls)
        app.router.add_get("/repos/{owner}/{name}/releases/assets/{id}", self.asset)
        app.router.add_route("*", "/repos/{owner}/{name}/{tail:.*}", self.anything)

    def _authorised(self, request: web.Request) -> bool:
        self.seen.append((request.method, request.path_qs, dict(request.headers)))
        sent = request.headers.get("Authorization", "")
        taken = {*self.tokens, *self.also}
        if sent.startswith("Basic "):  # as GitHub takes a token in basic authentication too
            user, _, token = base64.b64decode(sent.removeprefix("Basic ")).decode().partition(":")
            return user == "x-access-token" and token in taken
        return sent.removeprefix("Bearer ") in taken

    async def repository(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"message": "Bad credentials"}, status=401)
        owner, name = request.match_info["owner"], request.match_info["name"]
        return web.json_response({"full_name": f"{owner}/{name}", "default_branch": "main"})

    async def open_pull(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"message": "Bad credentials"}, status=401)
        body = await request.json()
        self.pulls.append(body)
        number = len(self.pulls)
        return web.json_response(
            {"number": number, "title": body.get("title"), "head": {"ref": body.get("head")},
             "state": "open"},
            status=201,
        )  # fmt: skip

    async def list_pulls(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"message": "Bad credentials"}, status=401)
        return web.json_response([{"number": n + 1, **p} for n, p in enumerate(self.pulls)])

    async def asset(self, request: web.Request) -> web.Response:
        """A release asset: a redirect to storage, with a token of its own in the URL."""
        if not self._authorised(request):
            return web.json_response({"message": "Bad credentials"}, status=401)
        where = "https://objects.example.test/asset?token=presigned-download-token"
        return web.Response(status=302, headers={"Location": where})

    async def anything(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"message": "Bad credentials"}, status=401)
        return web.json_response({"message": "done", "path": request.path})

    async def access_tokens(self, request: web.Request) -> web.Response:
        self.asked += 1
        auth = request.headers.get("Authorization", "")
        try:
            claims = jwt.decode(
                auth.removeprefix("Bearer "), self.public, algorithms=["RS256"],
                options={"require": ["iat", "exp", "iss"]},
            )  # fmt: skip
        except jwt.PyJWTError as exc:
            return web.json_response(
                {"message": f"A JSON web token could not be decoded ({exc})"}, status=401
            )
        if claims["iss"] != "12" or claims["exp"] - claims["iat"] > 600:
            return web.json_response({"message": "'Issuer' claim is wrong"}, status=401)
        if request.match_info["installation"] != "34":
            return web.json_response({"message": "Not Found"}, status=404)
        body = await request.json()
        if not set(body["repositories"]) <= self.repositories:
            return web.json_response(
                {"message": "There is at least one repository that does not exist"}, status=422
            )
        self.minted.append(body)
        token = f"ghs_minted_{len(self.minted)}"
        self.tokens.append(token)
        expires = datetime.now(UTC) + timedelta(hours=1)
        return web.json_response(
            {
                "token": token,
                "expires_at": expires.isoformat().replace("+00:00", "Z"),
            },
            status=201,
        )
