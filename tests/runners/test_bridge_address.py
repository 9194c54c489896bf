"""Where sandboxes reach this host (runners/host/containers/engine.py, bridge_address): the
gateway Docker reports, or else the address of the bridge interface the network names, which
is what Docker engines that found docker0 already configured leave out."""

import json
import subprocess

import psutil
import pytest

from runners.host.containers.engine import Engine, EngineError, bridge_address

# A host whose bridge reports no gateway, or has another address than Docker's usual one.
pytestmark = pytest.mark.suite("faults")

DEFAULT_BRIDGE = {
    "Name": "bridge",
    "Id": "0123456789abcdef",
    "Driver": "bridge",
    "IPAM": {"Driver": "default", "Options": None, "Config": [{"Subnet": "172.17.0.0/16"}]},
    "Options": {
        "com.docker.network.bridge.default_bridge": "true",
        "com.docker.network.bridge.name": "docker0",
    },
}
INTERFACES = {"lo": ["127.0.0.1"], "eth0": ["10.1.2.3"], "docker0": ["172.17.0.1"]}


def with_config(network: dict, *configs: dict) -> dict:
    return {**network, "IPAM": {**network["IPAM"], "Config": list(configs)}}


@pytest.mark.parametrize(
    ("network", "interfaces", "expected"),
    [
        # The gateway Docker reports wins, whatever the interfaces say.
        (
            with_config(DEFAULT_BRIDGE, {"Subnet": "172.17.0.0/16", "Gateway": "172.17.0.1"}),
            {},
            "172.17.0.1",
        ),
        # No gateway reported (the engine found docker0 configured): docker0's address.
        (DEFAULT_BRIDGE, INTERFACES, "172.17.0.1"),
        # An IPv6 config first, and an IPv4 one without a gateway.
        (
            with_config(
                DEFAULT_BRIDGE,
                {"Subnet": "fd00::/64", "Gateway": "fd00::1"},
                {"Subnet": "172.17.0.0/16"},
            ),
            INTERFACES,
            "172.17.0.1",
        ),
        # The interface has several addresses: the one inside the network's subnet.
        (DEFAULT_BRIDGE, {"docker0": ["192.168.5.1", "172.17.0.1"]}, "172.17.0.1"),
        # A user-defined network with no bridge name in its options: br-<id>.
        (
            {**DEFAULT_BRIDGE, "Name": "mine", "Options": {}},
            {"br-0123456789ab": ["172.17.0.1"]},
            "172.17.0.1",
        ),
    ],
)
def test_it_finds_the_hosts_address_on_a_bridge(network, interfaces, expected):
    assert bridge_address(network, interfaces) == expected


def test_it_says_what_it_looked_at_when_there_is_no_address():
    with pytest.raises(EngineError, match=r"no gateway, and its bridge interface docker0 has"):
        bridge_address(DEFAULT_BRIDGE, {"eth0": ["10.1.2.3"]})
    # An address outside the network's subnet is not where its containers reach the host.
    with pytest.raises(EngineError, match=r"docker0 has 192\.168\.5\.1 in 172\.17\.0\.0/16"):
        bridge_address(DEFAULT_BRIDGE, {"docker0": ["192.168.5.1"]})


def test_it_refuses_networks_that_reach_no_host_address():
    host = {**DEFAULT_BRIDGE, "Name": "host", "Driver": "host", "IPAM": {"Config": []}}
    with pytest.raises(EngineError, match="is a host network"):
        bridge_address(host, INTERFACES)


@pytest.mark.docker
def test_on_this_engine_the_fallback_gives_the_default_bridges_interface_address():
    """Whatever this engine reports, the fallback (no gateway) finds the same address."""
    inspected = json.loads(
        subprocess.run(
            ["docker", "network", "inspect", "bridge"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout
    )[0]  # fmt: skip
    interface = inspected["Options"]["com.docker.network.bridge.name"]
    addresses = {
        name: [a.address for a in found if a.family.name == "AF_INET"]
        for name, found in psutil.net_if_addrs().items()
    }
    without_gateway = with_config(
        inspected,
        *(
            {k: v for k, v in config.items() if k != "Gateway"}
            for config in inspected["IPAM"]["Config"]
        ),
    )
    address = bridge_address(without_gateway, addresses)
    assert address in addresses[interface]
    assert Engine("address").bridge_address() == address
    assert Engine("address").gateway() == address


@pytest.mark.docker
def test_the_command_prints_it_and_fails_loudly_for_a_network_that_is_not_there():
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="does not exist"):
        call_command("sandbox_host_address", "--network", "covey-no-such-network")
