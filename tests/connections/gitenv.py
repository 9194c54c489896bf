"""The environment the tests of connections/ run the real git in: no system or user
configuration of this machine, a fixed author, and no prompt for a password."""

import os
from pathlib import Path


def git_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(home),
        "GIT_AUTHOR_NAME": "Agent",
        "GIT_AUTHOR_EMAIL": "agent@covey.test",
        "GIT_COMMITTER_NAME": "Agent",
        "GIT_COMMITTER_EMAIL": "agent@covey.test",
    }
