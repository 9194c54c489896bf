"""What a sandbox of an agent with grants is told: git's configuration for its remotes, its
APIs' and registries' URLs at the gateway, all with the run's token and nothing else secret."""

from runners.host.runner import brokered_environment
from runners.protocol import GitRemote, Registry

GATEWAY = "http://172.17.0.1:8002/"
TOKEN = "covey-gw-run-token"


def test_git_is_led_to_the_gateway_with_the_run_s_token_and_apis_are_named():
    remotes = (
        GitRemote(
            url="https://ghe.acme.test", host="ghe.acme.test", name="ghe", api_host="api.acme.test"
        ),
        GitRemote(url="https://git.acme.test:8443/", host="git.acme.test:8443", name="acme-forge"),
    )
    told = brokered_environment(GATEWAY, TOKEN, remotes, ())
    assert told == {
        "COVEY_TOKEN": TOKEN,
        "GIT_CONFIG_COUNT": "3",
        "GIT_CONFIG_KEY_0": "url.http://172.17.0.1:8002/git/ghe.acme.test/.insteadOf",
        "GIT_CONFIG_VALUE_0": "https://ghe.acme.test/",
        "GIT_CONFIG_KEY_1": "url.http://172.17.0.1:8002/git/git.acme.test:8443/.insteadOf",
        "GIT_CONFIG_VALUE_1": "https://git.acme.test:8443/",
        "GIT_CONFIG_KEY_2": "http.http://172.17.0.1:8002/git/.extraHeader",
        "GIT_CONFIG_VALUE_2": f"Authorization: Bearer {TOKEN}",
        "COVEY_API_GHE": "http://172.17.0.1:8002/api/api.acme.test",
    }


def test_every_registry_has_its_url_and_none_is_made_pip_s_own():
    registries = (
        Registry(name="pypi-private", paths=("/simple/", "/packages/")),
        Registry(name="npm", paths=("/",)),
    )
    told = brokered_environment(GATEWAY, TOKEN, (), registries)
    index = f"http://covey:{TOKEN}@172.17.0.1:8002/registry/pypi-private"
    assert told == {
        "COVEY_TOKEN": TOKEN,
        "COVEY_REGISTRY_PYPI_PRIVATE": index,
        "COVEY_REGISTRY_NPM": f"http://covey:{TOKEN}@172.17.0.1:8002/registry/npm",
        "PIP_TRUSTED_HOST": "172.17.0.1:8002",
    }
