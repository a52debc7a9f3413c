"""How a benchmark's engine phase ends when it cannot finish: one line on stderr and an exit code.

Every benchmark that starts engines runs them inside a `Cluster`, which stops every
process it started when the block is left, however it is left (a Ctrl-C, the SIGTERM it
turns into `SystemExit`, an engine that did not start, a measurement that failed). What
is left to say is the same for all of them, so they say it here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdconnect.testbed.processes import StartupError

__all__ = ["engine_phase"]


@contextmanager
def engine_phase(name: str, logs: Path, *failures: type[Exception]) -> Iterator[None]:
    """Run a benchmark's engine phase (the `Cluster` block inside it); if it is interrupted or
    fails (`StartupError`, `RuntimeError` or one of `failures`), say so as `[name] ...` on
    stderr and leave with `SystemExit`: 130 for Ctrl-C, the signal's code for SIGTERM, 1 for
    a failure."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        print(f"\n[{name}] interrupted: every process it started has been stopped", file=sys.stderr)
        raise SystemExit(130 if isinstance(exc, KeyboardInterrupt) else (exc.code or 1)) from None
    except (StartupError, RuntimeError, *failures) as exc:  # type: ignore[misc]  # mypy cannot see a starred tuple of types
        print(
            f"\n[{name}] FAILED: {exc}\n[{name}] every process it started has been stopped; logs in {logs}",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
