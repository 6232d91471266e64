"""Whom a TCP peer's address counts as, where a server counts what one client does: the metrics server's password
checks (web/server.AuthLine) and the proxy's book of the engine's ends (proxy/casualties.py). An address alone would
let one client be many: an IPv6 host is usually given a /64, and a local user may connect from any of 127.0.0.0/8's
2**24 addresses."""

from __future__ import annotations

import ipaddress
import socket
import time


def source_of(peer: str) -> str:
    """Whom what a client does is counted against (a password check, an end of the engine it was in flight at): the
    client's address, an IPv6 one by its /64 (what one host, or one customer of a provider, is usually given: 2**64
    addresses would be 2**64 sources), and the rest of 127.0.0.0/8 beside 127.0.0.1 (where a local Prometheus or
    client comes from) as one: any local user may connect from each of its 2**24 addresses (a crowd guessing
    passwords from a fresh one each time filled the metrics server's line with sources that never failed, and kept
    out a scraper from any other address: 0 of 30 scrapes). An IPv4 address mapped into IPv6 is the IPv4 one; what
    is no address at all is itself."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if address.version == 6 and address.ipv4_mapped is None:
        return str(ipaddress.ip_network((address, 64), strict=False))
    address = getattr(address, "ipv4_mapped", None) or address
    text = str(address)
    return "127.0.0.0/8" if address.is_loopback and text != "127.0.0.1" else text


THIS_HOST = "this host"  # every address of this host's own, as one client (host_of)
_OWN_MAX = 1024  # addresses whose answer is kept (host_of)
_OWN_FOR_S = 60.0  # how long an answer is kept: an address added to or taken off an interface is seen within this
_own: dict[str, tuple[bool, float]] = {}
_tables: list = [None, None]  # local_networks' answer and when it was read


_TABLE_MAX = 4 << 20  # bytes of /proc/net/fib_trie read at most (a host with a full routing table: the bind test)
FIB_TRIE, IF_INET6 = "/proc/net/fib_trie", "/proc/net/if_inet6"


def local_networks(fib_trie: str = FIB_TRIE, if_inet6: str = IF_INET6) -> list | None:
    """This host's own addresses, as the kernel's local routes name them: the 'host LOCAL' entries of the IPv4
    tables (127.0.0.0/8 among them) and every interface's IPv6 address; None where either cannot be read whole."""
    found = []
    try:
        with open(fib_trie, "rb") as f:
            text = f.read(_TABLE_MAX + 1)
        with open(if_inet6, "rb") as f:
            inet6 = f.read(_TABLE_MAX + 1)
    except OSError:
        return None
    if len(text) > _TABLE_MAX or len(inet6) > _TABLE_MAX:
        return None
    last = None
    for line in text.decode("ascii", "replace").splitlines():
        line = line.strip()
        if line.startswith(("|-- ", "+-- ")):
            last = line[4:].split()[0]
        elif line.endswith("host LOCAL") and last and line.startswith("/"):
            try:
                found.append(ipaddress.ip_network(f"{last}/{line[1:].split()[0]}", strict=False))
            except ValueError:
                continue
    for line in inet6.decode("ascii", "replace").splitlines():
        word = line.split()[0] if line.split() else ""
        if len(word) == 32:
            try:
                found.append(ipaddress.ip_network(ipaddress.IPv6Address(bytes.fromhex(word))))
            except ValueError:
                continue
    return found


def _bound(ip) -> bool:
    """Whether a socket may bind the address: only an address of this host's own, unless the host lets any be bound
    (net.ipv4.ip_nonlocal_bind, keepalived's hosts: then a bind alone would pass every remote address), which
    local_networks, asked first, does not depend on."""
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
        return True
    except OSError:
        return False


def own_address(address: str, clock=time.monotonic, networks=local_networks) -> bool:
    """Whether address is one of this host's own: all of 127.0.0.0/8 and ::1, and any address the kernel's local
    routes name (an interface's: local_networks; the bind test where they cannot be read). The answer is kept for
    _OWN_FOR_S, _OWN_MAX at most."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return True
    now = clock()
    kept = _own.get(address)
    if kept is not None and now - kept[1] <= _OWN_FOR_S:
        return kept[0]
    if networks is local_networks:  # read once per _OWN_FOR_S, not per address (a routing table may be megabytes)
        if _tables[1] is None or now - _tables[1] > _OWN_FOR_S:
            _tables[:] = [local_networks(), now]
        local = _tables[0]
    else:
        local = networks()
    own = _bound(ip) if local is None else any(ip.version == n.version and ip in n for n in local)
    if len(_own) >= _OWN_MAX:
        _own.clear()
    _own[address] = (own, now)
    return own


def host_of(peer: str) -> str:
    """Whom a TCP peer counts as where one local user must not be several clients (the proxy's book of the engine's
    ends): THIS_HOST for any address of this host's own (a local user may connect from 127.0.0.1, any of
    127.0.0.0/8, ::1 or any address an interface has, and is one user whichever it takes; all local users are one
    client: a known limit), else source_of's."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    address = getattr(address, "ipv4_mapped", None) or address
    if own_address(str(address)):
        return THIS_HOST
    return source_of(peer)
