"""Malformed `kv_transfer_params`, generated from the wire types: every JSON type at every level of a real plan.

`cases(plan)` walks the `TransferPlan` declaration (msgspec's type info, not a hand-written
list) alongside a plan a prefill engine really returned, and yields one case per
(place, JSON value): the whole params, each field of the plan, each list's first element
and each field of the first group and run. The values cover every JSON type: null, both
booleans, integers (zero, negative, beyond 64 bits), a float, strings, arrays and objects.

`expected_ask` is the oracle, written from the same declaration, the plan's documented
value rules and the connector's documented leg rule, independently of the msgspec decode
under test: "invalid" params must be refused as such; a "plan" may be loaded, or refused
by the decode engine's plan checks; "none" asks for no hand-off. Nothing may crash.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from pdconnect.protocol import PROTOCOL_VERSION, TransferPlan

__all__ = ["JSON_VALUES", "Case", "cases", "expected_ask", "json_type", "well_typed"]

# One or more values of each JSON type. 2**64 - 1 is past every signed 64-bit integer and
# the largest vLLM accepts in extra_args (it answers 400 to a larger one itself).
JSON_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    7,
    2**64 - 1,
    1.5,
    "",
    "x",
    [],
    [1],
    ["x"],
    [[1]],
    {},
    {"a": 1},
)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Case:
    """`plan` with the value at `path` replaced by `value` (the whole params when `path` is empty)."""

    path: Path
    value: Any
    params: Any

    @property
    def name(self) -> str:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path) or "<params>"
        return f"{where}={msgspec.json.encode(self.value).decode()}"


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    for kind, names in ((int, "int"), (float, "float"), (str, "str"), (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return names
    raise TypeError(f"not a JSON value: {value!r}")


def _paths(info: mi.Type, value: Any, here: Path) -> Iterator[Path]:
    """Every place in `value` (shaped as `info`) a case replaces: each field, each list's first item."""
    if isinstance(info, mi.UnionType):
        info = next(t for t in info.types if not isinstance(t, mi.NoneType))
    if isinstance(info, mi.StructType):
        for field in info.fields:
            yield (*here, field.name)
            if isinstance(value, dict) and field.name in value:
                yield from _paths(field.type, value[field.name], (*here, field.name))
    elif isinstance(info, mi.ListType) and isinstance(value, list) and value:
        yield (*here, 0)
        yield from _paths(info.item_type, value[0], (*here, 0))


def _replaced(plan: dict[str, Any], path: Path, value: Any) -> Any:
    if not path:
        return copy.deepcopy(value)
    params = copy.deepcopy(plan)
    parent: Any = params
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = copy.deepcopy(value)
    return params


def cases(plan: dict[str, Any], values: tuple[Any, ...] = JSON_VALUES) -> list[Case]:
    """Every JSON value at every place of `plan`, a valid plan as a prefill engine returned it."""
    places = [(), *_paths(mi.type_info(TransferPlan), plan, ())]
    return [Case(path, value, _replaced(plan, path, value)) for path in places for value in values]


# --- the oracle ---------------------------------------------------------------------------

# Value rules the plan documents beyond its types (TransferPlan's checks).
_VALUE_RULES = {
    "remote_port": lambda v: 0 < v < 65536,
    "num_prompt_tokens": lambda v: v > 0,
    "pdconnect": lambda v: v == PROTOCOL_VERSION,
}


def _fits(info: mi.Type, value: Any) -> bool:
    kind = json_type(value)
    if isinstance(info, mi.UnionType):
        return any(_fits(t, value) for t in info.types)
    if isinstance(info, mi.NoneType):
        return kind == "null"
    if isinstance(info, mi.BoolType):
        return kind == "bool"
    if isinstance(info, mi.IntType):
        return kind == "int" and (info.ge is None or value >= info.ge)
    if isinstance(info, mi.FloatType):
        return kind in ("int", "float")
    if isinstance(info, mi.StrType):
        return kind == "str"
    if isinstance(info, mi.ListType):
        return kind == "array" and all(_fits(info.item_type, item) for item in value)
    if isinstance(info, mi.StructType):
        if kind != "object" or set(value) - {f.name for f in info.fields}:
            return False
        return all(
            (f.name in value and _fits(f.type, value[f.name])) or (f.name not in value and not f.required)
            for f in info.fields
        )
    raise AssertionError(f"the plan declares a type the oracle does not know: {info}")


def well_typed(params: Any) -> bool:
    """True if `params` is a plan of the declared JSON types and documented value ranges."""
    if not _fits(mi.type_info(TransferPlan), params):
        return False
    return all(rule(params[name]) for name, rule in _VALUE_RULES.items() if name in params)


def expected_ask(params: Any) -> str:
    """What a decode engine must make of `params`: "none", "invalid" or "plan".

    The leg rule: params must be an object whose `do_remote_prefill` and
    `do_remote_decode` are booleans, null or absent; they ask for a load only when
    `do_remote_prefill` is true and `do_remote_decode` is not, and must then be a plan.
    """
    if params is None:
        return "none"
    if json_type(params) != "object":
        return "invalid"
    flags = [params.get(name) for name in ("do_remote_prefill", "do_remote_decode")]
    if any(json_type(flag) not in ("bool", "null") for flag in flags):
        return "invalid"
    if flags[0] is not True or flags[1] is True:
        return "none"
    return "plan" if well_typed(params) else "invalid"
