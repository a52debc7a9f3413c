"""The model KV geometries the planner tests run on: full-attention block, sliding block, window."""

from __future__ import annotations

__all__ = ["GEOMETRIES"]

# name -> (full-attention block size, sliding-window block size, window), in tokens.
GEOMETRIES = {
    "fa256-swa64-w128": (256, 64, 128),  # DeepSeek-V4-like, the design's worked example
    "fa128-swa32-w64": (128, 32, 64),
    "window-over-alignment": (128, 32, 320),
    "equal-blocks-128-w64": (128, 128, 64),  # the CPU engine's geometry
}
