"""Command-line options the engine benchmarks share: a subset of their named runs, where figures and logs go.

`make bench-handoff` and `make bench-parallel` each run a fixed table of named runs and let
a person pick some, write every figure to `--json` and the engines' logs under `--logs`;
the parsing and its errors are the same for both, so they live here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from pathlib import Path

from pdconnect.testbed.paths import default_build_dir

__all__ = ["add_output_options", "comma_subset"]


def comma_subset(choices: Collection[str], what: str) -> Callable[[str], list[str]]:
    """An argparse `type` reading `a, b` into the names, in the order given; any name not
    in `choices` (or none at all) is an error naming `what` and every choice."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(
                f"{what} are a comma-separated subset of {','.join(choices)}, got {text!r}"
            )
        return names

    return parse


def add_output_options(parser: argparse.ArgumentParser, target: str) -> None:
    """`--json PATH` (every figure) and `--logs DIR` (the engines' logs, under build/logs/`target`)."""
    parser.add_argument("--json", type=Path, help="also write every figure here")
    logs = default_build_dir() / "logs" / target
    parser.add_argument("--logs", type=Path, default=logs, help="the engines' logs (default: %(default)s)")
