"""A real sandbox calls its model through the real gateway with the variables its run was
given, as the Claude runtime and the SDKs do: the control plane (gunicorn), a runner process,
Docker, the gateway process and a fake vendor over TLS; at the cooperative level directly, and
under hard isolation through the runner's proxy container, for which the gateway is a built-in
destination of every agent."""

from decimal import Decimal

import pytest

from budgets import keys, services
from budgets.models import Charge, GatewayToken, Vendor
from runners.host.containers.engine import Engine
from runs import services as run_services
from runs.models import FINISHED, RunStatus
from tests.budgets.conftest import KEY, MODEL, OPENAI_KEY, OPENAI_MODEL, start_gateway
from tests.runners.conftest import egress_image, firewall  # noqa: F401 - fixtures
from tests.runners.stack import Stack
from tests.runners.world import World, runner_ids_apart

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]

REQUEST = (
    '{"model": "%s", "max_tokens": 100, "stream": %s,'
    ' "messages": [{"role": "user", "content": "%s"}]}'
)
SCRIPT = f"""
set -e
echo "base url: $ANTHROPIC_BASE_URL"
curl -sS --fail-with-body "$ANTHROPIC_BASE_URL/v1/messages" \\
    -H "x-api-key: $ANTHROPIC_API_KEY" -H "anthropic-version: 2023-06-01" \\
    -H "content-type: application/json" -d '{REQUEST % (MODEL, "false", "json")}'
echo
curl -sS --fail-with-body -N "$ANTHROPIC_BASE_URL/v1/messages" \\
    -H "Authorization: Bearer $ANTHROPIC_AUTH_TOKEN" -H "anthropic-version: 2023-06-01" \\
    -H "content-type: application/json" -d '{REQUEST % (MODEL, "true", "stream")}'
echo
if [ -n "${{OPENAI_BASE_URL:-}}" ]; then
    echo "openai base url: $OPENAI_BASE_URL"
    curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \\
        -H "Authorization: Bearer $OPENAI_API_KEY" -H "content-type: application/json" \\
        -d '{{"model": "{OPENAI_MODEL}", "messages": [{{"role": "user", "content": "json"}}]}}'
    echo
fi
env
grep -rlE "{KEY[:12]}|{OPENAI_KEY[:12]}" / --exclude-dir=proc --exclude-dir=sys 2>/dev/null \\
    || echo "no key here"
"""


def test_a_sandbox_reaches_its_model_with_its_runs_token_and_never_the_key(
    tmp_path, base_image, acme, alice, sonnet_price, openai_price, vendor, ca
):
    address = Engine("address").bridge_address(None)  # where sandboxes reach this host
    with start_gateway(tmp_path, vendor, ca, host=address) as gateway:
        stack = Stack(tmp_path, base_image, COVEY_MODEL_GATEWAY_URL=gateway.url)
        try:
            runner, config = stack.register(acme, "edge-1")
            agent = stack.agent(acme, "Caller", ["sh", "-c", SCRIPT])
            keys.set_model_key(acme, KEY)
            keys.set_model_key(acme, OPENAI_KEY, Vendor.OPENAI)
            services.set_budget(agent, Decimal(5))
            with stack.runner(runner, config):
                run = run_services.queue_run(agent, "call your model")
                stack.wait(run, *FINISHED, timeout=90)
            with stack.api(alice) as api:
                log = api.get(f"/api/v1/runs/{run.pk}/log/").text
        finally:
            stack.close()
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, log)
    assert f"base url: {gateway.url}" in log
    assert '"text": "Hello, world!"' in log and "message_stop" in log
    assert f"openai base url: {gateway.url}/openai/v1" in log
    assert '"content": "Hello, world!"' in log  # the OpenAI answer
    # Neither key in its environment or files.
    assert "no key here" in log and KEY not in log and OPENAI_KEY not in log
    charges = Charge.objects.filter(run=run).order_by("at", "pk")
    assert [(c.input_tokens, c.cache_read_tokens, c.output_tokens, c.model) for c in charges] == [
        (120, 10, 42, MODEL),
        (120, 10, 42, MODEL),
        (120, 30, 42, f"{OPENAI_MODEL}-2025-01-01"),
    ]
    assert [seen.headers.get("x-api-key") for seen in vendor.seen[-3:]] == [KEY, KEY, None]
    assert vendor.seen[-1].headers["Authorization"] == f"Bearer {OPENAI_KEY}"
    (token,) = GatewayToken.objects.filter(run=run)
    assert token.revoked_at is not None  # it ended with the run


def test_under_hard_isolation_the_gateway_is_reached_through_the_proxy(
    tmp_path,
    base_image,
    egress_image,  # noqa: F811 - the fixture imported above
    acme,
    sonnet_price,
    vendor,
    ca,
):
    runner_ids_apart()
    address = Engine("address").bridge_address(None)  # what the proxy container reaches
    with start_gateway(tmp_path, vendor, ca, host=address) as gateway:
        world = World(tmp_path, base_image, egress_image, COVEY_MODEL_GATEWAY_URL=gateway.url)
        try:
            runner, config = world.register(acme, "isolated-gw")
            # Its allowlist names nothing on this machine: the gateway is allowed as built in.
            agent = world.stack.agent(acme, "Isolated caller", ["sh", "-c", SCRIPT])
            keys.set_model_key(acme, KEY)
            services.set_budget(agent, Decimal(5))
            with world.stack.runner(runner, config, **world.runner_env()):
                run = world.stack.wait(
                    run_services.queue_run(agent, "call your model"), *FINISHED, timeout=90
                )
        finally:
            world.close()
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    log = run.log_tail
    assert "HTTP_PROXY=http://" in log and "NO_PROXY=localhost,127.0.0.1,::1\n" in log
    assert '"text": "Hello, world!"' in log and "message_stop" in log
    assert "no key here" in log and KEY not in log
    charges = Charge.objects.filter(run=run)
    assert sorted((c.input_tokens, c.output_tokens) for c in charges) == [(120, 42), (120, 42)]
    assert "OPENAI_BASE_URL" not in log  # the organisation has no OpenAI key
