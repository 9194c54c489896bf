"""A stand-in of GitHub's API for the tests (served over TLS with a test CA): it mints
installation tokens only to a JSON Web Token signed with the app's key, as GitHub does, and
a git host beside it (tests/connections/githost.py) takes the tokens it minted."""

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
        self.tokens = [] if tokens is None else tokens  # each token minted (a git host's list)

    async def access_tokens(self, request: web.Request) -> web.Response:
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
