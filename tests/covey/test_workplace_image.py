"""The default workplace image (make workplace-image): what an agent works with, as the agent."""

import subprocess

import pytest

pytestmark = pytest.mark.docker

TOOLS = (
    "claude --version && node --version && npm --version && python3 -m pip --version"
    " && python3 -m venv /tmp/venv && git --version && curl --version && rg --version"
    " && jq --version && cc --version && make --version && command -v covey-request"
)


def test_the_workplace_has_the_claude_runtime_and_the_tools_as_the_agent(workplace_image):
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--user", "1000:1000",
         "--label", "covey.test=workplace-image", workplace_image, "sh", "-ec", TOOLS],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(Claude Code)" in done.stdout
    node = next(line for line in done.stdout.splitlines() if line.startswith("v"))
    assert int(node[1:].split(".")[0]) % 2 == 0  # an LTS line (even), as pinned


def test_the_runtime_neither_updates_itself_nor_reports_home(workplace_image):
    env = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .Config.Env}}", workplace_image],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "DISABLE_AUTOUPDATER=1" in env and "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1" in env
