"""bench-lookup at a small size: every geometry's row, the hit each warm index is built to
give, and the tokenizer timed on the same prompt length."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kv_lookup import GEOMETRIES, main


def test_the_lookup_benchmark_reports_each_geometry_with_its_expected_hit(tmp_path: Path) -> None:
    out = tmp_path / "bench-lookup.json"
    assert main(["--tokens", "8192", "--repeats", "1", "--json", str(out)]) == 0
    rows = {row["geometry"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(GEOMETRIES)
    # The sliding group misses every other block of the last 8 windows: the hit is where
    # those start. Block 16, window 128 (8 blocks): 512 - 64 blocks. Block 64, window 128
    # (2 blocks): 128 - 16 blocks. Block 256, window 512 (2 blocks): 32 - 16 blocks.
    assert rows["FA16+SWA16/w128"]["hit_tokens"] == 448 * 16
    assert rows["FA64+SWA64/w128"]["hit_tokens"] == 112 * 64
    assert rows["FA64+FA64+SWA256/w512"]["hit_tokens"] == 16 * 256
    for row in rows.values():
        assert row["first_ms"] > 0 and row["next_ms"] > 0 and row["miss_ms"] > 0
        assert row["tokenize_ms"] > 0 and row["first_over_tokenize"] > 0  # build/models' tokenizer
