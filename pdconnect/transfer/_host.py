"""What this host offers the transports, and the environment knobs their libraries read.

Mooncake and UCX are configured through environment variables read when an engine or
agent starts, so the only way to configure them per transport is to set variables
around that moment; this module owns that, so nothing else touches `os.environ`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = ["env_defaults", "rdma_devices", "scoped_env"]

_SYSFS_RDMA = Path("/sys/class/infiniband")

# The process environment is shared by every thread; two transports starting at once
# must not see each other's temporary settings.
_ENV_LOCK = threading.Lock()


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes (e.g. ["mlx5_0"]); empty on a host without RDMA."""
    try:
        return sorted(p.name for p in _SYSFS_RDMA.iterdir())
    except OSError:
        return []


def env_defaults(defaults: Mapping[str, str]) -> None:
    """Set each variable unless the operator already did (their value wins)."""
    with _ENV_LOCK:
        for name, value in defaults.items():
            os.environ.setdefault(name, value)


@contextmanager
def scoped_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) variables for the duration of a library start-up."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in values}
        try:
            for name, value in values.items():
                _put(name, value)
            yield
        finally:
            for name, value in saved.items():
                _put(name, value)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
