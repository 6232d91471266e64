"""Whom a TCP peer's address counts as, where a server counts what one client does: the metrics server's password
checks (web/server.AuthLine) and the proxy's book of the engine's ends (proxy/casualties.py). An address alone would
let one client be many: an IPv6 host is usually given a /64, and a local user may connect from any of 127.0.0.0/8's
2**24 addresses."""

from __future__ import annotations

import ipaddress


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
