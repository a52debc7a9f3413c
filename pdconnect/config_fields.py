"""Bounds declared once, on a config's field types, and checked from there.

A setting's constraint is part of its type: `lease_seconds: Annotated[float, Meta(gt=0,
description=...)] = 30.0`. `check_bounds` reads those annotations off a dataclass and
raises a `ConfigError` naming the first field out of bounds, its bound and its value, so
a config's `__post_init__` no longer keeps hand-written lists of names per bound (which
drift from the fields: a new field is unchecked until someone adds it to a list).
`help_of` gives the same declaration's description to a CLI.

The annotation is msgspec's `Meta`, so the same declaration is enforced by msgspec itself
wherever the config is decoded by msgspec (a `Struct`, `msgspec.convert`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

from msgspec import Meta

from pdconnect.errors import ConfigError

__all__ = ["Meta", "bounds_of", "check_bounds", "help_of"]


def _meta(hint: Any) -> Meta | None:
    """The `Meta` of an annotation: `Annotated[T, Meta(...)]`, or that `| None`."""
    if get_origin(hint) is Annotated:
        return next((m for m in get_args(hint)[1:] if isinstance(m, Meta)), None)
    if get_origin(hint) in (Union, UnionType):
        return next((m for m in map(_meta, get_args(hint)) if m is not None), None)
    return None


@functools.cache
def bounds_of(cls: type) -> dict[str, Meta]:
    """Each field of the dataclass `cls` with a `Meta` in its annotation, and that `Meta`."""
    hints = get_type_hints(cls, include_extras=True)
    return {name: meta for name, hint in hints.items() if (meta := _meta(hint)) is not None}


def _violation(meta: Meta, value: Any) -> str | None:
    """The bound `value` breaks, as the message's words, or None."""
    checks = (
        (meta.gt, operator.gt, ">"),
        (meta.ge, operator.ge, ">="),
        (meta.lt, operator.lt, "<"),
        (meta.le, operator.le, "<="),
    )
    broken = [f"{words} {bound}" for bound, holds, words in checks if bound is not None and not holds(value, bound)]
    if meta.min_length is not None and len(value) < meta.min_length:
        broken.append(f"at least {meta.min_length} long")
    return " and ".join(broken) or None


def check_bounds(config: Any) -> None:
    """Raise `ConfigError` for the first field of the dataclass instance `config` outside
    its declared bounds. A field whose value is None (an optional setting left unset) is
    not checked."""
    assert dataclasses.is_dataclass(config) and not isinstance(config, type), config
    for name, meta in bounds_of(type(config)).items():
        value = getattr(config, name)
        if value is None:
            continue
        broken = _violation(meta, value)
        if broken is not None:
            described = f" ({meta.description})" if meta.description else ""
            raise ConfigError(f"{name} must be {broken}, got {value!r}{described}")


def help_of(cls: type, name: str) -> str:
    """The description declared on field `name` of `cls`, for `--help`."""
    meta = bounds_of(cls).get(name)
    return meta.description or "" if meta is not None else ""
