"""Where the local rig writes: the repository's git-ignored `build/` (models, logs, caches)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_build_dir"]


def default_build_dir() -> Path:
    """The repository's git-ignored `build/` (override: `PDCONNECT_BUILD_DIR`).

    Found from this file when running from a checkout, else from the working directory,
    so an installed package still writes next to the project it is run from.
    """
    if override := os.environ.get("PDCONNECT_BUILD_DIR"):
        return Path(override)
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for parent in start.parents if start.is_file() else (start, *start.parents):
            if (parent / "pyproject.toml").is_file() and (parent / "pdconnect").is_dir():
                return parent / "build"
    return Path.cwd() / "build"
