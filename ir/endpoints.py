"""The one parser of ``host:port`` endpoints and endpoint lists.

The transpiler (``transpile(pservers=..., trainers=..., current_endpoint=...)``) and the runtime (the
``PADDLE_*`` variables, the launcher's flags) read the same text; one parser means an endpoint one accepts
the other connects to, and a typo (``a:1;b:2``, ``http://a:1``) is refused where it is written instead of
becoming one unreachable endpoint that a trainer then waits for until its deadline. Each caller turns
``EndpointSyntaxError`` into its own coded error (the transpiler's E701, the launcher's E803); ``what``
names the argument, variable or flag the text came from, and starts the message.

An endpoint is ``host:port``: the host a DNS name (letters, digits, ``-``, ``_``, dot-separated labels), an
IPv4 address or a bracketed IPv6 address (``[::1]:6174``); the port a decimal in 1..65535. A list
separates endpoints with commas.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any

HINT = "write an endpoint as host:port (e.g. 127.0.0.1:6174) and a list as host:port,host:port"

_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?")
_WRONG_SEPARATORS = (";", " ", "\t", "|")


class EndpointSyntaxError(ValueError):
    """Text that is not an endpoint (or endpoint list); ``hint`` says how to write it."""

    def __init__(self, message: str, hint: str = HINT) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def _host_problem(host: str) -> str | None:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host[1:-1]!r} in brackets is not an IPv6 address"
        return None
    if ":" in host:
        return "an IPv6 host must be bracketed, as in [::1]:6174"
    labels = host.split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"its host {host!r} is not an IPv4 address"
        return None
    bad = next((label for label in labels if not _LABEL.fullmatch(label)), None)
    if bad is not None or len(host) > 253:
        return (f"its host {host!r} is not a host name (letters, digits, '-' and '_' in dot-separated labels)")
    return None


def endpoint_problem(item: str) -> str | None:
    """Why ``item`` (already stripped) is not ``host:port``, or None when it is one."""
    if not item:
        return "it is empty"
    if "://" in item:
        return f"it has a URL scheme {item.split('://', 1)[0] + '://'!r}; write host:port without it"
    separator = next((s for s in _WRONG_SEPARATORS if s in item), None)
    if separator is not None:
        return f"it contains {separator!r}; separate endpoints with a comma"
    host, sep, port_text = item.rpartition(":")
    if not sep or not host:
        return "it has no host:port form"
    if not port_text.isdigit():
        return f"its port {port_text!r} is not a decimal number"
    if not 1 <= int(port_text) <= 65535:
        return f"its port {int(port_text)} is outside 1..65535"
    return _host_problem(host)


def parse_endpoint(text: Any, what: str) -> tuple[str, int]:
    """``host:port`` → ``(host, port)``."""
    if not isinstance(text, str):
        raise EndpointSyntaxError(f"{what}: endpoint {text!r} is malformed: it is a {type(text).__name__}, not a "
                                  "host:port string")
    item = text.strip()
    problem = endpoint_problem(item)
    if problem is not None:
        raise EndpointSyntaxError(f"{what}: endpoint {item!r} is malformed: {problem} (expected host:port with a "
                                  "port in 1..65535)")
    host, _, port_text = item.rpartition(":")
    return host, int(port_text)


def format_endpoint(host: str, port: int) -> str:
    """The canonical text of an endpoint: ``host:port``."""
    return f"{host}:{port}"


def canonical_endpoint(text: Any, what: str) -> str:
    """``text`` checked and written canonically (blanks stripped, the port without leading zeros)."""
    return format_endpoint(*parse_endpoint(text, what))


def parse_endpoint_list(endpoints: Any, what: str) -> tuple[str, ...]:
    """A comma-separated string (or a list of strings) → canonical endpoints; empty lists and items and
    duplicates are errors."""
    if isinstance(endpoints, str):
        items: list[Any] = endpoints.split(",")
    elif isinstance(endpoints, (list, tuple)):
        items = list(endpoints)
    else:
        raise EndpointSyntaxError(f"{what} must be a comma-separated string of host:port endpoints, got "
                                  f"{endpoints!r}",
                                  hint='e.g. "127.0.0.1:6174,127.0.0.1:6175"')
    if not items or items == [""] or all(isinstance(i, str) and not i.strip() for i in items):
        raise EndpointSyntaxError(f"{what} is empty; expected at least one host:port endpoint")
    result: list[str] = []
    for position, item in enumerate(items):
        if isinstance(item, str) and not item.strip():
            raise EndpointSyntaxError(f"{what}: item {position} of {endpoints!r} is empty",
                                      hint=HINT + " (no empty items, no trailing comma)")
        endpoint = canonical_endpoint(item, what)
        if endpoint in result:
            raise EndpointSyntaxError(f"{what}: endpoint {endpoint} appears twice (listed more than once) in "
                                      f"{endpoints!r}",
                                      hint="every process needs an endpoint of its own; remove the duplicate")
        result.append(endpoint)
    return tuple(result)
