"""Addresses: the one loopback test and host:port parser every listener and client uses.

Nothing listens beyond loopback unless configured, so each server asks `is_loopback`
before binding; clients that allow plaintext only to loopback ask it too.

>>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("10.0.0.1")
(True, True, True, False)
>>> split_host_port("[::1]:9701")
('::1', 9701)
"""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming `what` and the text."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not host:port")
    return host.strip("[]"), int(port)
