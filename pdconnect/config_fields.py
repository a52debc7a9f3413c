"""Bounds declared once, on a config's field types, and checked from there.

A setting's constraint is part of its type: `lease_seconds: Annotated[float, Meta(gt=0,
description=...)] = 30.0`. `check_bounds` reads those annotations off a dataclass and
raises a `ConfigError` naming the first field out of bounds, its bound and its value, so
a config's `__post_init__` no longer keeps hand-written lists of names per bound (which
drift from the fields: a new field is unchecked until someone adds it to a list). A
bound's `description` says why it is there, at the end of the error.

The annotation is msgspec's `Meta`, so the same declaration is enforced by msgspec itself
wherever the config is decoded by msgspec (a `Struct`, `msgspec.convert`). msgspec's own
error names the field and the bound but not the value, and it is raised before a
`Struct`'s `__post_init__` runs: `check_values` checks a mapping before it is decoded, so
an operator reads the same message either way. `Seconds`, `AtLeastOne` and `Port` are the
bounds most settings share.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta

from pdconnect.errors import ConfigError

__all__ = ["AtLeastOne", "Meta", "Port", "Seconds", "check_bounds", "check_values"]

# A duration that must pass; a count of which there must be one (attempts, bytes, blocks); a TCP port (0 binds any).
Seconds = Annotated[float, Meta(gt=0)]
AtLeastOne = Annotated[int, Meta(ge=1)]
Port = Annotated[int, Meta(ge=0, le=65535)]


def _meta(hint: Any) -> Meta | None:
    """The `Meta` of an annotation: `Annotated[T, Meta(...)]`, or that `| None`."""
    if get_origin(hint) is Annotated:
        return next((m for m in get_args(hint)[1:] if isinstance(m, Meta)), None)
    if get_origin(hint) in (Union, UnionType):
        return next((m for m in map(_meta, get_args(hint)) if m is not None), None)
    return None


@functools.cache
def _bounds_of(cls: type) -> dict[str, Meta]:
    """Each field of the dataclass or `msgspec.Struct` `cls` with a `Meta` in its annotation, and that `Meta`."""
    hints = get_type_hints(cls, include_extras=True)
    return {name: meta for name, hint in hints.items() if (meta := _meta(hint)) is not None}


def _violation(meta: Meta, value: Any) -> str | None:
    """The bound `value` breaks, as the message's words, or None."""
    checks = (
        (meta.gt, operator.gt, "positive" if meta.gt == 0 else ">"),
        (meta.ge, operator.ge, ">="),
        (meta.lt, operator.lt, "<"),
        (meta.le, operator.le, "<="),
    )
    broken = [
        words if words == "positive" else f"{words} {bound}"
        for bound, holds, words in checks
        if bound is not None and not holds(value, bound)
    ]
    if meta.min_length is not None and len(value) < meta.min_length:
        broken.append(f"at least {meta.min_length} long")
    return " and ".join(broken) or None


def _check(name: str, meta: Meta, value: Any) -> None:
    broken = _violation(meta, value)
    if broken is not None:
        described = f" ({meta.description})" if meta.description else ""
        raise ConfigError(f"{name} must be {broken}, got {value!r}{described}")


def check_bounds(config: Any) -> None:
    """Raise `ConfigError` for the first field of the dataclass or `msgspec.Struct`
    instance `config` outside its declared bounds. A field whose value is None (an
    optional setting left unset) is not checked."""
    assert (dataclasses.is_dataclass(config) or isinstance(config, msgspec.Struct)) and not isinstance(config, type)
    for name, meta in _bounds_of(type(config)).items():
        value = getattr(config, name)
        if value is not None:
            _check(name, meta, value)


def _comparable(meta: Meta, value: Any) -> bool:
    """Whether `value` is of a type its bounds apply to; anything else is msgspec's to refuse."""
    if meta.min_length is not None:
        return isinstance(value, str | bytes | list | tuple | dict)
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_values(cls: type, values: Mapping[str, Any]) -> None:
    """`check_bounds` for a mapping about to be decoded into `cls` (keys spelled as its
    fields): the first bounded value out of bounds raises the same `ConfigError`."""
    for name, meta in _bounds_of(cls).items():
        value = values.get(name)
        if _comparable(meta, value):
            _check(name, meta, value)
