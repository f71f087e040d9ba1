"""PYCOLLECT_SOCKET_IFNAME specs: names, =exact, comma lists, ^exclusions, CIDR, IPv6, loopback rules."""

import ipaddress

import pytest

import pycollect as pc
from pycollect.plugins import interfaces
from pycollect.plugins.interfaces import choose_address, parse_interface_spec

pytestmark = pytest.mark.timeout(30)

# A made-up machine: loopback, two Ethernet ports, a container bridge, an IPv6-only link.
MACHINE = [("lo", "127.0.0.1"), ("eth0", "198.18.0.1"), ("eth1", "198.19.5.5"),
           ("docker0", "198.18.200.1"), ("lo", "::1"), ("eth0", "fe80::1"),
           ("eth0", "fd00::1"), ("ib0", "fd00:1::7")]


@pytest.fixture
def machine(monkeypatch):
    """Make MACHINE this machine's addresses, and route every host through ``routes``."""
    routes = {}
    monkeypatch.setattr(interfaces, "local_addresses", lambda: [
        (name, ipaddress.ip_address(address)) for name, address in MACHINE])
    monkeypatch.setattr(interfaces, "_route_source",
                        lambda host: ipaddress.ip_address(routes[host]) if host in routes
                        else None)
    monkeypatch.delenv("PYCOLLECT_SOCKET_IFNAME", raising=False)
    return routes


class _StoreAt:
    def __init__(self, host):
        self.host = host


@pytest.mark.parametrize("spec, address", [
    ("eth0", "198.18.0.1"),                  # a name: its IPv4 address first
    ("eth", "198.18.0.1"),                   # a name prefix, spec order then machine order
    ("=eth1", "198.19.5.5"),                 # exactly that name
    ("docker0,eth1", "198.18.200.1"),        # list order decides
    ("^lo,docker", "198.18.0.1"),            # everything but lo* and docker*
    ("^lo,docker,eth0", "198.19.5.5"),
    ("198.19.0.0/16", "198.19.5.5"),         # an IPv4 range
    ("fd00::/16", "fd00::1"),                # an IPv6 range, link-local left out
    ("ib0", "fd00:1::7"),                    # an IPv6-only interface
    ("=ib0,eth1", "198.19.5.5"),             # IPv4 before IPv6 across the list
    ("[fd00::1]", "fd00::1"),                # one address, brackets allowed
    ("lo", "127.0.0.1"),                     # loopback when named on purpose
    ("127.0.0.0/8", "127.0.0.1"),
])
def test_specs_pick_the_expected_address(machine, spec, address):
    assert choose_address(spec, None)[0] == address


def test_the_route_to_the_store_wins_among_allowed_addresses(machine):
    machine["store-host"] = "198.19.5.5"
    address, why = choose_address("eth", _StoreAt("store-host"))
    assert address == "198.19.5.5" and "route to store host store-host" in why
    # A route through an interface the spec excludes does not count.
    assert choose_address("=eth0", _StoreAt("store-host"))[0] == "198.18.0.1"


def test_the_environment_is_read_when_no_argument_is_given(machine, monkeypatch):
    monkeypatch.setenv("PYCOLLECT_SOCKET_IFNAME", "^lo,eth0")
    assert choose_address(None, None)[0] == "198.19.5.5"
    assert choose_address("=eth0", None)[0] == "198.18.0.1"


def test_loopback_only_by_name(machine):
    with pytest.raises(pc.InvalidArgument, match="matches no usable address"):
        choose_address("^eth,docker,ib", None)     # leaves only lo, which it does not name


@pytest.mark.parametrize("spec", ["wlan", "=eth", "10.0.0.0/8", "fe80::/10"])
def test_a_spec_that_allows_nothing_lists_the_interfaces(machine, spec):
    with pytest.raises(pc.InvalidArgument) as caught:
        choose_address(spec, None)
    assert spec in str(caught.value) and "eth1: 198.19.5.5" in str(caught.value)


@pytest.mark.parametrize("spec", ["", " , ", "^", "10.0.0.0/99", "not::an::address"])
def test_malformed_specs_are_invalid_arguments(spec):
    with pytest.raises(pc.InvalidArgument):
        parse_interface_spec(spec)


def test_default_without_spec_follows_the_route(machine):
    machine["store-host"] = "198.18.0.1"
    assert choose_address(None, _StoreAt("store-host")) == (
        "198.18.0.1", "route to store host store-host")


def test_this_machine_has_loopback_among_its_addresses():
    found = interfaces.local_addresses()
    assert ("lo", ipaddress.ip_address("127.0.0.1")) in found or \
        any(address.is_loopback for _, address in found)
