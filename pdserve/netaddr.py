"""Endpoints a request or a peer names, checked before anything connects to them.

A client names the prefill it wants (`bootstrap_host`, `bootstrap_port`); a decode names
where its KV goes (`Ready.data_endpoint`). Both become ZeroMQ `tcp://` endpoints this
process connects to, so each is checked here first, at the HTTP edge and on the wire:

    host       a hostname (RFC 1123 labels), a dotted IPv4 address, or an IPv6 address
               (bracketed, or bare where it stands alone); nothing else (no spaces, no
               wildcard "*", no interface names, no other transport's syntax)
    port       1..65535
    endpoint   "tcp://" host ":" port, nothing else (no ipc://, inproc://, pgm://, ...)

A leaf module: the frontends and the transfer both import it.
"""

from __future__ import annotations

import ipaddress
import re

MAX_HOST_CHARS = 253  # the longest DNS name
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_problem(host: object) -> str:
    """Why `host` is not a host this process may connect to ("" if it is)."""
    if not isinstance(host, str) or not host:
        return "must be a non-empty string"
    if len(host) > MAX_HOST_CHARS + 2:
        return f"longer than {MAX_HOST_CHARS} characters"
    if _ip(host) is not None:
        return ""
    if host.startswith("[") or ":" in host:
        return f"{_show(host)} is not an IPv4 address, an IPv6 address or a hostname"
    name = host[:-1] if host.endswith(".") else host
    if len(name) > MAX_HOST_CHARS or not all(_LABEL.fullmatch(p) for p in name.split(".")):
        return f"{_show(host)} is not a valid hostname (letters, digits, '-' and '.')"
    return ""


def port_problem(port: object) -> str:
    if isinstance(port, bool) or not isinstance(port, int):
        return "must be an integer"
    if not 1 <= port <= 65535:
        return f"{port} outside [1, 65535]"
    return ""


def bootstrap_problem(host: object, port: object) -> tuple[str, str] | None:
    """(field, why) of the first bad field of a request's bootstrap address, or None.
    A field left out (None) is not checked here: a decode refuses a request without
    both where it needs them (a prefill leg needs neither)."""
    fields = (("bootstrap_host", host, host_problem), ("bootstrap_port", port, port_problem))
    for field, value, problem in fields:
        why = "" if value is None else problem(value)
        if why:
            return field, f"{field}: {why}"
    return None


def tcp_endpoint(host: str | None, port: int | None) -> str:
    """The ZeroMQ endpoint of `host` and `port` (ValueError naming the bad field)."""
    if host is None or port is None:
        raise ValueError("no bootstrap address (bootstrap_host and bootstrap_port)")
    bad = bootstrap_problem(host, port)
    if bad is not None:
        raise ValueError(bad[1])
    ip = _ip(host)
    shown = f"[{ip.compressed}]" if isinstance(ip, ipaddress.IPv6Address) else host
    return f"tcp://{shown}:{port}"


def endpoint_problem(endpoint: object) -> str:
    """Why `endpoint` is not a "tcp://host:port" this process may connect to."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return f"{_show(endpoint)} is not a tcp:// endpoint"
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5:
        return f"{_show(endpoint)} has no port"
    why = host_problem(host) or port_problem(int(port))
    return f"{_show(endpoint)}: {why}" if why else ""


def is_ipv6_endpoint(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a socket reachable from this machine only."""
    if host == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv4Address) and text != host:
        return None  # "[1.2.3.4]" is neither form
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return None  # "%eth0": an interface name in an address a client chose
    return ip


def _show(value: object, limit: int = 80) -> str:
    """`value` for an error message, cut short: the text is the sender's, not ours."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"
