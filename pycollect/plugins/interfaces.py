"""Which local address a rank listens on: interface specs, the route to the store, no loopback by accident.

``PYCOLLECT_SOCKET_IFNAME`` (or ``init(interface=...)``) is a comma list; each
item is one of

- an interface name prefix (``eth`` matches ``eth0`` and ``eth1``), or ``=NAME``
  for exactly that name;
- an address range in CIDR form (``198.18.0.0/15``, ``fd00::/8``);
- one address (``10.1.2.3``, ``::1`` or ``[::1]``).

A list that starts with ``^`` excludes instead: every interface except those
the items match (``^lo,docker``).  Among the addresses a spec allows, the one
the kernel would use to reach the store's host wins, else the first one in
spec order (IPv4 before IPv6, link-local IPv6 never).  A loopback address is
taken only when the spec names it on purpose.  Without a spec: the route to
the store's host, else the address the host name resolves to, else loopback
(which the TCP rendezvous then refuses for a job that spans hosts).
"""

import ctypes
import ctypes.util
import ipaddress
import socket
import struct
import sys

from .. import settings
from ..errors import InvalidArgument

__all__ = ["choose_address", "local_addresses", "parse_interface_spec", "store_host"]

IFF_UP = 0x1
# Longest chain of wrapped stores searched for a host name.
MAX_STORE_WRAPPING = 16
# Longest list of interfaces followed through getifaddrs (a guard against a corrupt list).
MAX_ADDRESSES = 4096


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p),
                     ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.c_void_p),
                     ("ifa_netmask", ctypes.c_void_p), ("ifa_ifu", ctypes.c_void_p),
                     ("ifa_data", ctypes.c_void_p)]


def _sockaddr_address(pointer):
    """The IP address in a ``struct sockaddr`` (IPv4 or IPv6), else None."""
    if not pointer:
        return None
    if sys.platform == "darwin":        # BSD layout: length byte, then family byte
        family = ctypes.c_uint8.from_address(pointer + 1).value
    else:
        family = ctypes.c_ushort.from_address(pointer).value
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(ctypes.string_at(pointer + 4, 4))
    if family == socket.AF_INET6:
        return ipaddress.IPv6Address(ctypes.string_at(pointer + 8, 16))
    return None


def _getifaddrs():
    """[(interface, address)] from the C library's getifaddrs, for interfaces that are up."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        node = head
        while node and len(found) < MAX_ADDRESSES:
            entry = node.contents
            address = _sockaddr_address(entry.ifa_addr)
            if address is not None and entry.ifa_flags & IFF_UP:
                found.append((entry.ifa_name.decode(errors="replace"), address))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def _ioctl_addresses():
    """[(interface, address)] without getifaddrs: each interface's first IPv4, then IPv6."""
    import fcntl
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
                found.append((name, ipaddress.IPv4Address(packed[20:24])))
            except OSError:
                pass
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    found.append((fields[5], ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return found


def local_addresses():
    """Every address of every interface that is up: [(interface, ipaddress object)]."""
    try:
        return _getifaddrs()
    except (OSError, AttributeError, TypeError):
        return _ioctl_addresses()


def _usable(address):
    return not (address.version == 6 and address.is_link_local)


def parse_interface_spec(spec):
    """``(exclude, items)``: items are ("name", prefix), ("exact", name), ("net", network)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgument("an interface spec must be a non-empty str, got %r" % (spec,))
    text = spec.strip()
    exclude = text.startswith("^")
    items = []
    for raw in text.lstrip("^").split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("="):
            items.append(("exact", item[1:]))
            continue
        try:
            items.append(("net", ipaddress.ip_network(item.strip("[]"), strict=False)))
        except ValueError:
            if "/" in item or item.count(":") > 1:
                raise InvalidArgument("interface spec %r: %r is neither an interface name nor "
                                      "an address range" % (spec, item)) from None
            items.append(("name", item))
    if not items:
        raise InvalidArgument("interface spec %r names nothing" % spec)
    return exclude, items


def _matches(item, name, address):
    kind, value = item
    if kind == "exact":
        return name == value
    if kind == "name":
        return name.startswith(value)
    return address.version == value.version and address in value


def _candidates(spec, addresses):
    """The (interface, address) pairs ``spec`` allows, in spec order."""
    exclude, items = parse_interface_spec(spec)
    if exclude:
        return [(n, a) for n, a in addresses if not any(_matches(i, n, a) for i in items)]
    ordered = []
    for item in items:
        for pair in addresses:
            if _matches(item, *pair) and pair not in ordered:
                ordered.append(pair)
    return ordered


def store_host(store):
    """The host name of the server behind ``store`` (unwrapping prefixes), if any."""
    for _ in range(MAX_STORE_WRAPPING):
        if store is None:
            return None
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "store", None)
    return None


def _route_source(host):
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(sockaddr)
                return ipaddress.ip_address(probe.getsockname()[0].partition("%")[0])
            except OSError:
                continue
    return None


def _describe(addresses):
    by_name = {}
    for name, address in addresses:
        by_name.setdefault(name, []).append(str(address))
    return "; ".join("%s: %s" % (name, ", ".join(found)) for name, found in by_name.items()) \
        or "none"


def _from_spec(spec, host):
    """Pick from the addresses ``spec`` allows (see the module docstring)."""
    try:
        single = ipaddress.ip_address(spec.strip().strip("[]"))
    except ValueError:
        single = None
    if single is not None:
        return str(single), "given address"
    addresses = local_addresses()
    allowed = [(n, a) for n, a in _candidates(spec, addresses) if _usable(a)]
    exclude, items = parse_interface_spec(spec)
    loopback_named = not exclude and any(
        (kind == "net" and value.network_address.is_loopback) or
        (kind in ("name", "exact") and value.startswith("lo")) for kind, value in items)
    if not loopback_named:
        allowed = [(n, a) for n, a in allowed if not a.is_loopback]
    if not allowed:
        raise InvalidArgument("%s=%r matches no usable address of this machine (interfaces "
                              "that are up: %s)" % ("PYCOLLECT_SOCKET_IFNAME", spec, _describe(addresses)))
    if host:
        try:
            routed = _route_source(host)
        except OSError:
            routed = None
        for name, address in allowed:
            if address == routed:
                return str(address), "interface %s (%s), the route to store host %s" % (
                    name, spec, host)
    allowed.sort(key=lambda pair: pair[1].version)      # stable: IPv4 first, spec order kept
    name, address = allowed[0]
    return str(address), "interface %s (%s)" % (name, spec)


def choose_address(interface, store):
    """Pick the address to listen on: ``interface``, else PYCOLLECT_SOCKET_IFNAME, else by route.

    Returns ``(address, why)``.
    """
    spec = interface or settings.get("PYCOLLECT_SOCKET_IFNAME")
    host = store_host(store)
    if spec:
        return _from_spec(spec, host)
    if host:
        try:
            routed = _route_source(host)
        except OSError as exc:
            raise InvalidArgument("cannot find a route to the store host %r: %s" % (host, exc))
        if routed is not None:
            return str(routed), "route to store host %s" % host
    try:
        named = ipaddress.ip_address(socket.gethostbyname(socket.gethostname()))
        if not named.is_loopback:
            return str(named), "host name %s" % socket.gethostname()
    except (OSError, ValueError):
        pass
    return "127.0.0.1", "loopback (no store host, host name does not resolve elsewhere)"
