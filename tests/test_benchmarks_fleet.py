"""bench-fleet at a small size: both geometries ingested through the router's real path from
vLLM's own managers' events, every probe's prediction equal to vLLM's hit, and after a
restart that replays only the last batches, none above it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from benchmarks.fleet import GEOMETRIES, main


def test_the_fleet_benchmark_predicts_vllms_hits_and_never_above_them_after_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "bench-fleet.json"
    args = ["--engines", "4", "--dp-ranks", "2", "--conversations", "5", "--min-tokens", "2048"]
    args += ["--max-tokens", "12288", "--probes", "3", "--replay-steps", "3", "--json", str(out)]
    assert main(args) == 0
    rows = {row["geometry"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(GEOMETRIES)
    for row in rows.values():
        assert row["probes"] == 4 * 3 and row["requests"] >= 4 * 5
        assert row["mispredicted"] == [] and row["restart_above_vllm"] == []
        # Three replayed batches cannot hold every probed conversation: the restart check
        # covered history the router could not rebuild (predicted below vLLM, P/D).
        assert row["restart_exact"] < row["probes"]
        assert row["ingest_events_per_s"] > 0 and row["held_blocks"] > 0
        assert row["lookup_p99_ms"] >= row["lookup_p50_ms"] > 0
        assert len(row["memory_points"]) == 4
