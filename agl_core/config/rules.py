"""What one config key's value must be: a :class:`Rule`, declared beside the key's field in the schema.

:func:`agl_core.config.checks.validate` applies every rule of the schema (and then the checks that
span keys), so a key's type, default and range are written in one place.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from typing import Any

import attrs
from omegaconf import OmegaConf

from agl_core.config.errors import ConfigError
from agl_core.fields import is_int, is_number

__all__ = [
    "Rule",
    "at_least",
    "boolean",
    "finite",
    "host",
    "http_url",
    "integer",
    "number",
    "one_of",
    "paths",
    "port_number",
]


@attrs.frozen
class Rule:
    """``test(value)`` must hold; ``what`` says what the value must be in the error naming the key.
    ``choices``: the values a key of fixed choices takes (empty for any other rule)."""

    test: Callable[[Any], bool]
    what: str
    nullable: bool = False
    choices: tuple[str, ...] = ()

    def check(self, key: str, value: Any) -> None:
        if value is None and self.nullable:
            return
        if not self.test(value):
            raise ConfigError(key, f"must be {self.what}{' or null' if self.nullable else ''}, got {value!r}")

    def or_null(self) -> Rule:
        return attrs.evolve(self, nullable=True)


def integer(minimum: int = 1) -> Rule:
    """An int (not a bool) of at least ``minimum``; by default a positive int."""
    what = "a positive integer" if minimum == 1 else f"an integer of {minimum} or more"
    return Rule(lambda v: is_int(v, minimum), what)


def number(test: Callable[[float], bool], what: str) -> Rule:
    """An int or float (not a bool, not NaN) for which ``test`` holds."""
    return Rule(lambda v: is_number(v) and not math.isnan(v) and test(v), what)


def at_least(low: float, *, strictly: bool = False) -> Rule:
    """A number above ``low`` (``strictly``) or of ``low`` or more."""
    if strictly:
        return number(lambda v: v > low, f"greater than {low!r}")
    return number(lambda v: v >= low, f"{low!r} or more")


def finite(low: float, *, strictly: bool = False) -> Rule:
    """A finite number above ``low`` (``strictly``) or of ``low`` or more."""
    if strictly:
        return number(lambda v: low < v < math.inf, f"a finite number greater than {low!r}")
    return number(lambda v: low <= v < math.inf, f"a finite number of {low!r} or more")


def one_of(*choices: str) -> Rule:
    return Rule(lambda v: v in choices, f"one of {', '.join(choices)}", choices=choices)


def boolean() -> Rule:
    return Rule(lambda v: isinstance(v, bool), "true or false")


def port_number() -> Rule:
    """A TCP port number, or 0 for a free one."""
    return Rule(lambda v: is_int(v, 0) and v <= 65535, "0 (a free port) or a port number")


def http_url() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.startswith(("http://", "https://")), "an http(s) URL")


def paths() -> Rule:
    """A path, or a list of paths (a YAML list or an omegaconf one)."""
    return Rule(
        lambda v: isinstance(v, str) or (OmegaConf.is_list(v) and all(isinstance(p, str) for p in v)),
        "a path or a list of paths",
    )


LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}$){LABEL}(\.{LABEL})*")


def _is_host(value: Any, ipv6: bool) -> bool:
    if not isinstance(value, str):
        return False
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return HOST_NAME.fullmatch(value) is not None
    return ipv6 or address.version == 4


def host(*, ipv6: bool = True) -> Rule:
    """A host name or an IP address (IPv4 only unless ``ipv6``), with no scheme and no port."""
    what = f"a host name or an {'IP' if ipv6 else 'IPv4'} address (no scheme, no port)"
    return Rule(lambda value: _is_host(value, ipv6), what)
