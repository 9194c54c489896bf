"""What a sandbox is told about the proxy at the cooperative level (COVEY_EGRESS_ENFORCE).

Cooperative means exactly that: well-behaved tools (curl, pip, npm, git, apt with its proxy
setting) honour these variables, and a process that ignores them can go around the proxy.
Only COVEY_EGRESS_ISOLATION=network makes the proxy the sandbox's only way out.
"""

from collections.abc import Sequence
from urllib.parse import quote

# The sandbox's own loopback is the sandbox itself; everything else goes through the proxy.
NO_PROXY = "localhost,127.0.0.1,::1"
# The proxy's request desk (egress/proxy/desk.py), which sandboxes reach through it (.invalid
# is reserved: no real host has the name), and the header that carries the SHA-256 of the
# agent's credential from the proxy to the control plane.
DESK_HOST = "requests.covey.invalid"
DESK_TOKEN_HEADER = "X-Covey-Token-SHA256"  # noqa: S105 - a header's name


def proxy_environment(
    proxy_host: str, proxy_port: int, credentials: str, direct: Sequence[str] = ()
) -> dict[str, str]:
    """HTTP(S)_PROXY in both spellings, carrying the agent's ``username:token``; ``direct``:
    more names the sandbox reaches without the proxy (its workplace's services, which are its
    own loopback)."""
    username, _, token = credentials.partition(":")
    url = f"http://{quote(username, safe='')}:{quote(token, safe='')}@{proxy_host}:{proxy_port}"
    env = {}
    for name in ("http_proxy", "https_proxy"):
        env[name] = env[name.upper()] = url
    env["no_proxy"] = env["NO_PROXY"] = ",".join([NO_PROXY, *direct])
    return env
