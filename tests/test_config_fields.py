"""Config bounds declared on field types: checked from the declaration, named in the error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
import pytest

from pdconnect.config_fields import AtLeastOne, Meta, Port, Seconds, check_bounds, check_values
from pdconnect.errors import ConfigError


@dataclass(frozen=True)
class _Settings:
    lease_seconds: Annotated[float, Meta(gt=0, description="how long prefill holds unclaimed blocks")] = 30.0
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    ratio: Annotated[float, Meta(gt=0, le=1)] = 0.5
    secret: Annotated[str, Meta(min_length=32)] | None = None
    name: str = "unbounded"

    def __post_init__(self) -> None:
        check_bounds(self)


def test_values_inside_their_bounds_pass() -> None:
    _Settings(lease_seconds=0.1, port=65535, ratio=1.0, secret="k" * 32)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lease_seconds": 0}, "lease_seconds must be positive, got 0 (how long prefill holds unclaimed blocks)"),
        ({"port": -1}, "port must be >= 0, got -1"),
        ({"port": 65536}, "port must be <= 65535, got 65536"),
        ({"ratio": 0.0}, "ratio must be positive, got 0.0"),
        ({"ratio": 1.5}, "ratio must be <= 1, got 1.5"),
        ({"secret": "short"}, "secret must be at least 32 long, got 'short'"),
    ],
)
def test_a_value_out_of_bounds_is_refused_naming_field_bound_and_value(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _Settings(**changes)  # type: ignore[arg-type]  # the cases' values are typed by field, not here
    assert str(refused.value) == message


def test_a_field_without_bounds_takes_any_value() -> None:
    assert _Settings(name="").name == ""


def test_msgspec_enforces_the_same_declaration_when_it_decodes_the_config() -> None:
    assert msgspec.convert({"port": 80}, _Settings).port == 80
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` <= 65535 - at `\$.port`"):
        msgspec.convert({"port": 70000}, _Settings)


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    """A config as the router's and the connector's are: a Struct, with the shared bounds."""

    lease_seconds: Seconds = 30.0
    attempts: AtLeastOne = 2
    port: Port | None = None

    def __post_init__(self) -> None:
        check_bounds(self)


def test_a_struct_built_directly_is_checked_from_its_declarations() -> None:
    for changes, message in (
        ({"attempts": 0}, "attempts must be >= 1, got 0"),
        ({"lease_seconds": -1.0}, "lease_seconds must be positive, got -1.0"),
        ({"port": 65536}, "port must be <= 65535, got 65536"),
    ):
        with pytest.raises(ConfigError) as refused:
            _Struct(**changes)
        assert str(refused.value) == message


def test_a_mapping_is_checked_before_decoding_naming_the_value_msgspec_would_not() -> None:
    check_values(_Struct, {"lease_seconds": 0.5, "port": None, "attempts": "two", "other": -1})  # types: msgspec's
    with pytest.raises(ConfigError) as refused:
        check_values(_Struct, {"attempts": 1, "port": 70000})
    assert str(refused.value) == "port must be <= 65535, got 70000"
    with pytest.raises(msgspec.ValidationError, match=r"\$.port"):
        msgspec.convert({"port": 70000}, _Struct)  # what the message would be without check_values
